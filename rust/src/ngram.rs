//! [`NGramHash`]: Qwen4Exp's n-gram PLE row ids on the host, for a step whose tokens the
//! host knows (a prefill chunk's), equal to vLLM 0.33.0's `compute_ngram_ids`.
//!
//! For each token and each n-gram order `n` (2..=`ngram_size`) the hash is
//! `xor_{k<n}(token[t - k] * multiplier[k])` with 64-bit wrapping products; a predecessor
//! at or before the last EOS before `t` reads as EOS, and each request's chunk is preceded
//! by its `ngram_size - 1` context tokens (the tokens before the chunk). Each of the
//! `heads_per_ngram` heads of an order maps the hash into its own vocabulary:
//! `offset[h] + rem_euclid(hash, size[h])`. Ids come `[token, head]` row-major, orders
//! ascending, heads within an order, as vLLM's.
//!
//! Pure computation: no unsafe code, no allocation per call beyond the caller's output.

use strength_reduce::StrengthReducedU64;

use crate::error::{Error, Result};

/// One PLE layer's n-gram hash (the buffers vLLM's loader left in the module).
#[derive(Debug, Clone)]
pub struct NGramHash {
    multipliers: Vec<i64>,
    sizes: Vec<i64>,
    offsets: Vec<i64>,
    eos: i64,
    heads_per_ngram: usize,
    divisors: Vec<StrengthReducedU64>,
}

/// `m.rem_euclid(size)` for a positive `size`, through its strength-reduced divisor.
fn rem_euclid(m: i64, d: &StrengthReducedU64) -> i64 {
    let r = m.unsigned_abs() % *d;
    if m >= 0 || r == 0 {
        r as i64
    } else {
        (d.get() - r) as i64
    }
}

impl NGramHash {
    /// `multipliers`: one per distance back (`ngram_size` of them); `sizes` and `offsets`:
    /// one per head, `(ngram_size - 1) * heads_per_ngram` of each, every size positive.
    pub fn new(
        multipliers: Vec<i64>,
        sizes: Vec<i64>,
        offsets: Vec<i64>,
        eos: i64,
        heads_per_ngram: usize,
    ) -> Result<Self> {
        let n = multipliers.len();
        if n < 2 || heads_per_ngram == 0 {
            return Err(Error::invalid(format!(
                "ngram_size {n} must be >= 2 and heads_per_ngram {heads_per_ngram} >= 1"
            )));
        }
        let heads = (n - 1) * heads_per_ngram;
        if sizes.len() != heads || offsets.len() != heads {
            return Err(Error::invalid(format!(
                "{} vocabulary sizes and {} offsets for {heads} heads",
                sizes.len(),
                offsets.len()
            )));
        }
        if sizes.iter().any(|&s| s <= 0) {
            return Err(Error::invalid(
                "every head's vocabulary size must be positive",
            ));
        }
        let divisors = sizes
            .iter()
            .map(|&s| StrengthReducedU64::new(s as u64))
            .collect();
        Ok(Self {
            multipliers,
            sizes,
            offsets,
            eos,
            heads_per_ngram,
            divisors,
        })
    }

    /// Row ids per token.
    pub fn heads(&self) -> usize {
        self.sizes.len()
    }

    /// Context tokens per request (`ngram_size - 1`).
    pub fn context(&self) -> usize {
        self.multipliers.len() - 1
    }

    /// The ids of `tokens` (the requests' chunks back to back), `query_start_loc`
    /// (`requests + 1` offsets, rising from 0; tokens past the last belong to the last
    /// request, as on the GPU) and `context` (`context()` tokens a request, row-major, at
    /// least one row a request) into `out` (`tokens.len() * heads()`).
    pub fn ids(
        &self,
        tokens: &[i64],
        query_start_loc: &[i64],
        context: &[i64],
        out: &mut [i64],
    ) -> Result<()> {
        let (c, heads) = (self.context(), self.heads());
        let reqs = query_start_loc.len().saturating_sub(1);
        if reqs == 0 {
            return Err(Error::invalid(
                "query_start_loc needs at least two entries (one request)",
            ));
        }
        let rising = query_start_loc.windows(2).all(|w| w[0] <= w[1]);
        if query_start_loc[0] != 0 || !rising || query_start_loc[reqs] as usize > tokens.len() {
            return Err(Error::invalid(format!(
                "query_start_loc must rise from 0 to at most {} tokens, got {query_start_loc:?}",
                tokens.len()
            )));
        }
        if context.len() < reqs * c {
            return Err(Error::invalid(format!(
                "ngram_context has {} tokens, {c} needed for each of {reqs} requests",
                context.len()
            )));
        }
        if out.len() != tokens.len() * heads {
            return Err(Error::invalid(format!(
                "the output holds {} ids, {} tokens need {}",
                out.len(),
                tokens.len(),
                tokens.len() * heads
            )));
        }
        // One request's row: its context then its tokens; `back[k]` is the token k back
        // (EOS at or before the last EOS before the token).
        let mut row: Vec<i64> = Vec::new();
        for r in 0..reqs {
            let start = query_start_loc[r] as usize;
            let end = if r + 1 == reqs {
                tokens.len()
            } else {
                query_start_loc[r + 1] as usize
            };
            row.clear();
            row.extend_from_slice(&context[r * c..(r + 1) * c]);
            row.extend_from_slice(&tokens[start..end]);
            // The index of the last EOS strictly before position i (None: none).
            let mut last_eos: Option<usize> = None;
            for i in 0..row.len() {
                if i >= c {
                    let t = start + (i - c);
                    self.token_ids(&row, i, last_eos, &mut out[t * heads..(t + 1) * heads]);
                }
                if row[i] == self.eos {
                    last_eos = Some(i);
                }
            }
        }
        Ok(())
    }

    /// The ids of one token a request read from a token history (vLLM's
    /// `all_token_ids`: `history` row-major, `width` positions a request): request `i`'s
    /// token at `positions[i]` of history row `rows[i]`, after the `context()` tokens
    /// before it (EOS before position 0), into `out` (`rows.len() * heads()`). A decode
    /// step's ids, its tokens already in the history.
    pub fn ids_at(
        &self,
        history: &[i32],
        width: usize,
        rows: &[i64],
        positions: &[i64],
        out: &mut [i64],
    ) -> Result<()> {
        let (c, heads) = (self.context(), self.heads());
        if rows.len() != positions.len() || out.len() != rows.len() * heads {
            return Err(Error::invalid(format!(
                "{} rows, {} positions and an output of {} ids ({heads} a token)",
                rows.len(),
                positions.len(),
                out.len()
            )));
        }
        if width == 0 || history.len() % width != 0 {
            return Err(Error::invalid(format!(
                "a history of {} tokens is not rows of {width}",
                history.len()
            )));
        }
        let requests = history.len() / width;
        let mut row = vec![self.eos; c + 1];
        for (i, (&r, &p)) in rows.iter().zip(positions).enumerate() {
            if r < 0 || r as usize >= requests || p < 0 || p as usize >= width {
                return Err(Error::invalid(format!(
                    "request {i}: row {r}, position {p} outside a history of {requests} x \
                     {width}"
                )));
            }
            let at = r as usize * width;
            let mut last_eos = None;
            for (j, slot) in row.iter_mut().enumerate() {
                let back = c - j; // how far before the token
                *slot = if back as i64 > p {
                    self.eos
                } else {
                    i64::from(history[at + p as usize - back])
                };
                if j < c && *slot == self.eos {
                    last_eos = Some(j);
                }
            }
            self.token_ids(&row, c, last_eos, &mut out[i * heads..(i + 1) * heads]);
        }
        Ok(())
    }

    fn token_ids(&self, row: &[i64], i: usize, last_eos: Option<usize>, out: &mut [i64]) {
        let back = |k: usize| match last_eos {
            Some(e) if i - k <= e => self.eos,
            _ => row[i - k],
        };
        let h = self.heads_per_ngram;
        let mut mixed = back(0).wrapping_mul(self.multipliers[0]);
        for k in 1..self.multipliers.len() {
            mixed ^= back(k).wrapping_mul(self.multipliers[k]);
            let lo = (k - 1) * h;
            let heads = out[lo..lo + h]
                .iter_mut()
                .zip(&self.divisors[lo..lo + h])
                .zip(&self.offsets[lo..lo + h]);
            for ((id, d), &offset) in heads {
                *id = offset + rem_euclid(mixed, d);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::ErrorKind;

    fn hash() -> NGramHash {
        NGramHash::new(
            vec![0x9E37_79B9_7F4A_7C15_u64 as i64, 3, -5],
            vec![7, 11, 13, 1_000_003],
            vec![0, 7, 18, 31],
            2,
            2,
        )
        .unwrap()
    }

    /// The hash written out for one token, in i128 so the wrapping is explicit.
    fn reference(h: &NGramHash, seq: &[i64], t: usize) -> Vec<i64> {
        let last = (0..t).rev().find(|&i| seq[i] == h.eos);
        let back = |k: usize| {
            if last.is_some_and(|e| t - k <= e) {
                h.eos
            } else {
                seq[t - k]
            }
        };
        let wrap = |x: i128| x as i64; // two's complement truncation
        let mut ids = Vec::new();
        for n in 2..=h.multipliers.len() {
            let mut m: i64 = 0;
            for k in 0..n {
                m ^= wrap(i128::from(back(k)) * i128::from(h.multipliers[k]));
            }
            for j in 0..h.heads_per_ngram {
                let head = (n - 2) * h.heads_per_ngram + j;
                let s = i128::from(h.sizes[head]);
                let r = ((i128::from(m) % s) + s) % s;
                ids.push(h.offsets[head] + r as i64);
            }
        }
        ids
    }

    #[test]
    fn ids_are_the_hash_written_out() {
        let h = hash();
        let tokens = [5, 2, 9, i64::MAX, -3, 2, 2, 4, 8];
        let qsl = [0, 4, 4, 7];
        let ctx = [1, 2, 6, 7, 3, 3];
        let mut out = vec![0; tokens.len() * h.heads()];
        h.ids(&tokens, &qsl, &ctx, &mut out).unwrap();
        let rows: [(usize, usize, &[i64]); 3] =
            [(0, 4, &ctx[0..2]), (4, 4, &ctx[2..4]), (4, 9, &ctx[4..6])];
        for (start, end, c) in rows {
            let seq: Vec<i64> = c.iter().chain(&tokens[start..end]).copied().collect();
            for t in start..end {
                assert_eq!(
                    out[t * 4..t * 4 + 4],
                    reference(&h, &seq, t - start + 2),
                    "token {t}"
                );
            }
        }
    }

    #[test]
    fn ids_at_a_history_position_are_the_last_tokens_of_its_prefix() {
        let h = hash();
        let width = 6;
        #[rustfmt::skip]
        let history: [i32; 18] = [
            5, 9, 2, 4, 7, 1,
            3, 3, 8, 0, 0, 0,
            -4, 2, 6, 6, 1, 1,
        ];
        let rows = [0, 1, 2, 0, 2];
        let positions = [4, 0, 3, 1, 5];
        let mut out = vec![0; rows.len() * h.heads()];
        h.ids_at(&history, width, &rows, &positions, &mut out)
            .unwrap();
        for (i, (&r, &p)) in rows.iter().zip(&positions).enumerate() {
            // The whole prefix, EOS context first, as `ids` sees a request from its start.
            let at = r as usize * width;
            let seq: Vec<i64> = [2, 2]
                .into_iter()
                .chain(history[at..=at + p as usize].iter().map(|&t| i64::from(t)))
                .collect();
            assert_eq!(
                out[i * 4..i * 4 + 4],
                reference(&h, &seq, seq.len() - 1),
                "request {i}"
            );
        }
        let kind = |r: Result<()>| r.unwrap_err().kind();
        let mut one = vec![0; 4];
        for (rows, positions) in [([3], [0]), ([0], [6]), ([-1], [0]), ([0], [-1])] {
            assert_eq!(
                kind(h.ids_at(&history, width, &rows, &positions, &mut one)),
                ErrorKind::InvalidArgument
            );
        }
        assert_eq!(
            kind(h.ids_at(&history[..17], width, &[0], &[0], &mut one)),
            ErrorKind::InvalidArgument
        );
        assert_eq!(
            kind(h.ids_at(&history, width, &[0, 1], &[0], &mut one)),
            ErrorKind::InvalidArgument
        );
    }

    #[test]
    fn the_remainder_is_euclids_at_the_edges() {
        for size in [1i64, 2, 7, 1_000_003, 20_000_003, i64::MAX] {
            let d = StrengthReducedU64::new(size as u64);
            for m in [
                0,
                1,
                -1,
                size - 1,
                -size,
                i64::MIN,
                i64::MAX,
                i64::MIN + 1,
                12345,
                -12345,
            ] {
                assert_eq!(rem_euclid(m, &d), m.rem_euclid(size), "{m} mod {size}");
            }
        }
    }

    #[test]
    fn bad_arguments_are_refused() {
        let h = hash();
        let mut out = vec![0; 8];
        let kind = |r: Result<()>| r.unwrap_err().kind();
        assert_eq!(
            kind(h.ids(&[1, 2], &[0], &[0, 0], &mut out)),
            ErrorKind::InvalidArgument
        );
        assert_eq!(
            kind(h.ids(&[1, 2], &[0, 3], &[0, 0], &mut out)),
            ErrorKind::InvalidArgument
        );
        assert_eq!(
            kind(h.ids(&[1, 2], &[1, 2], &[0, 0], &mut out)),
            ErrorKind::InvalidArgument
        );
        assert_eq!(
            kind(h.ids(&[1, 2], &[0, 1, 2], &[0, 0], &mut out)),
            ErrorKind::InvalidArgument
        );
        assert_eq!(
            kind(h.ids(&[1, 2], &[0, 2], &[0, 0], &mut out[..7])),
            ErrorKind::InvalidArgument
        );
        h.ids(&[1, 2], &[0, 2], &[0, 0], &mut out).unwrap();
        assert!(NGramHash::new(vec![1], vec![], vec![], 0, 1).is_err());
        assert!(NGramHash::new(vec![1, 1], vec![0], vec![0], 0, 1).is_err());
        assert!(NGramHash::new(vec![1, 1], vec![3, 3], vec![0], 0, 2).is_err());
    }
}
