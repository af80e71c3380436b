//! [`RowMap`]: how a published id becomes a table row.

use crate::error::{Error, Result};

/// How a published id becomes a table row.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RowMap {
    /// The id is the row.
    Identity,
    /// Ids come in groups of `offsets.len()` heads (`[token, head]` row-major); head `h`'s
    /// id must lie in `0..sizes[h]` and maps to row `offsets[h] + id` (per-head
    /// vocabularies, as in Qwen4Exp's n-gram embedding).
    PerHead { offsets: Vec<i64>, sizes: Vec<i64> },
}

impl RowMap {
    /// Check the map against a table of `rows` rows.
    pub fn validate(&self, rows: u64) -> Result<()> {
        if let RowMap::PerHead { offsets, sizes } = self {
            if offsets.is_empty() || offsets.len() != sizes.len() {
                return Err(Error::invalid(format!(
                    "per-head map needs as many offsets as sizes (at least one), got {} and {}",
                    offsets.len(),
                    sizes.len()
                )));
            }
            for (h, (&o, &s)) in offsets.iter().zip(sizes).enumerate() {
                let end = o.checked_add(s);
                if o < 0 || s <= 0 || end.is_none_or(|e| e as u64 > rows) {
                    return Err(Error::invalid(format!(
                        "head {h}: rows {o}..{o}+{s} do not lie inside the table's {rows} rows"
                    )));
                }
            }
        }
        Ok(())
    }

    /// Map `ids` to rows into `out`, checking every id before anything is written.
    pub fn map(&self, ids: &[i64], out: &mut Vec<i64>, rows: u64, table: &str) -> Result<()> {
        out.clear();
        match self {
            RowMap::Identity => {
                if let Some((position, &id)) = ids
                    .iter()
                    .enumerate()
                    .find(|(_, &id)| id < 0 || id as u64 >= rows)
                {
                    return Err(Error::RowId {
                        id,
                        position,
                        rows,
                        table: table.to_string(),
                    });
                }
                out.extend_from_slice(ids);
            }
            RowMap::PerHead { offsets, sizes } => {
                let heads = offsets.len();
                for (position, &id) in ids.iter().enumerate() {
                    let h = position % heads;
                    if id < 0 || id >= sizes[h] {
                        return Err(Error::RowId {
                            id,
                            position,
                            rows: sizes[h] as u64,
                            table: format!("{table} (head {h} of {heads})"),
                        });
                    }
                    out.push(offsets[h] + id);
                }
            }
        }
        Ok(())
    }

    /// The row of the id at `position` of a step's ids, or `None` where [`Self::map`]
    /// would refuse it (no error: an expected id the GPU does not publish is no fault).
    pub fn row_at(&self, position: usize, id: i64, rows: u64) -> Option<i64> {
        match self {
            RowMap::Identity => (id >= 0 && (id as u64) < rows).then_some(id),
            RowMap::PerHead { offsets, sizes } => {
                let h = position % offsets.len();
                (id >= 0 && id < sizes[h]).then(|| offsets[h] + id)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::ErrorKind;

    #[test]
    fn per_head_map_checks_and_offsets() {
        let m = RowMap::PerHead {
            offsets: vec![0, 10],
            sizes: vec![10, 5],
        };
        m.validate(15).unwrap();
        assert!(m.validate(14).is_err());
        let mut out = Vec::new();
        m.map(&[3, 4, 9, 0], &mut out, 15, "t").unwrap();
        assert_eq!(out, vec![3, 14, 9, 10]);
        let e = m.map(&[3, 5], &mut out, 15, "t").unwrap_err();
        assert_eq!(e.kind(), ErrorKind::RowId);
        assert!(e.to_string().contains("head 1"), "{e}");
        let e = RowMap::Identity
            .map(&[0, -1], &mut out, 15, "t")
            .unwrap_err();
        assert!(matches!(
            e,
            Error::RowId {
                id: -1,
                position: 1,
                ..
            }
        ));
    }
}
