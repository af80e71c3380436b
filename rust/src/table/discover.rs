//! Finding a table in a safetensors checkpoint and proving its layout sound.
//!
//! Everything read from disk is untrusted: the index file, every header, every offset.
//! The safetensors crate parses and validates each header (offsets contiguous, sizes
//! matching shapes, buffer length matching the header); this module adds what a table
//! needs on top (2-D, a supported dtype, shards that agree and do not overlap, byte ranges
//! inside the mapping) and turns every failure into an error that names the file and the
//! tensor. Nothing here panics on any input; `fuzz/` and the proptests hold it to that.

use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::os::fd::AsRawFd;
use std::path::{Component, Path, PathBuf};

use memmap2::{Mmap, MmapOptions};
use safetensors::tensor::{Metadata, SafeTensorError, TensorInfo};
use safetensors::{Dtype, SafeTensors};

use super::sigbus::{self, Lost, Registration};
use crate::error::{Error, Result};

/// The index file a sharded checkpoint directory carries (Hugging Face convention).
pub const INDEX_FILE: &str = "model.safetensors.index.json";
/// The single-file checkpoint name looked for in a directory without an index.
pub const SINGLE_FILE: &str = "model.safetensors";
/// Placeholder for the shard index in a [`Selector::Pattern`].
pub const SHARD_PLACEHOLDER: &str = "{}";

/// Which tensor(s) of the checkpoint form the table.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Selector {
    /// One 2-D tensor, by exact name (Gemma 3n/4: `model.language_model.embed_tokens_per_layer.weight`).
    Name(String),
    /// Row shards whose names differ only in a decimal shard index at the one `{}`
    /// (Qwen4Exp: `model.layers.2.ple.ple_embedding.ngram_embedding.shard_{}.weight`).
    /// Shards `0..n` must all be present; their rows concatenate in shard order.
    Pattern(String),
}

impl Selector {
    /// The name or pattern, as the user wrote it.
    pub fn text(&self) -> &str {
        match self {
            Selector::Name(s) | Selector::Pattern(s) => s,
        }
    }
}

/// Element types a table may have. A row is raw bytes, so the gather never looks at
/// values; the list is closed so that a sub-byte or exotic type is refused up front
/// rather than silently producing rows of the wrong width.
pub fn supported_dtype(d: Dtype) -> Option<usize> {
    match d {
        Dtype::F8_E4M3 | Dtype::F8_E5M2 => Some(1),
        Dtype::BF16 | Dtype::F16 => Some(2),
        Dtype::F32 => Some(4),
        _ => None,
    }
}

/// A file of the checkpoint, mapped read-only for the life of the table.
pub(crate) struct MappedFile {
    /// The mapping's place in the SIGBUS guard (`None`: unguarded). First field: dropped
    /// before the descriptor and the mapping it names.
    pub guard: Option<Registration>,
    pub path: PathBuf,
    /// Kept open for `posix_fadvise` (dropping the file's cached pages).
    pub file: File,
    pub map: Mmap,
}

impl MappedFile {
    /// What a SIGBUS on the mapping lost (see `sigbus`); `None` while nothing is.
    #[inline(always)]
    pub fn lost(&self) -> Option<Lost> {
        self.guard.as_ref().and_then(Registration::lost)
    }

    /// `Err` if `off..off + len` touches a lost byte of the file (naming it and the offset).
    pub fn check_range(&self, off: usize, len: usize, what: &str) -> Result<()> {
        let Some(lost) = self.lost() else {
            return Ok(());
        };
        let Some(at) = lost.hits(off, len.max(1), crate::os::page_size()) else {
            return Ok(());
        };
        let why = match lost.from {
            Some(from) if at >= from => format!(
                "the file shrank to {from} bytes while the table was open (a read through \
                 its mapping raised SIGBUS); everything from offset {from} stays lost until \
                 the table is reopened"
            ),
            _ => format!(
                "the kernel could not read the page at offset {at} (a read through the \
                 mapping raised SIGBUS: an I/O error); it stays lost until the table is reopened"
            ),
        };
        Err(Error::Io {
            path: self.path.display().to_string(),
            detail: format!("{what} at offset {off} ({len} bytes): {why}"),
        })
    }

    /// `Err` if anything of the file was lost (the reads of opening it).
    fn check_whole(&self) -> Result<()> {
        self.check_range(0, self.map.len().max(1), "reading the header and tensors")
    }
}

/// One shard: a contiguous run of the table's rows inside one mapped file.
#[derive(Debug, Clone)]
pub(crate) struct Segment {
    /// Index into [`Layout::files`].
    pub file: usize,
    pub tensor: String,
    /// The table row of this shard's first row.
    pub first_row: u64,
    pub rows: u64,
    /// Absolute byte offset of the tensor's data in the mapping.
    pub start: usize,
    /// `rows * row_bytes`; `start + len <= map.len()` is checked at open.
    pub len: usize,
}

/// A validated table: what [`super::MmapTable`] serves rows from.
pub(crate) struct Layout {
    pub files: Vec<MappedFile>,
    pub segments: Vec<Segment>,
    pub dtype: Dtype,
    pub cols: usize,
    pub row_bytes: usize,
    pub rows: u64,
    pub scale: Option<f64>,
    pub scale_tensor: Option<String>,
}

fn table_err(file: &Path, detail: impl Into<String>) -> Error {
    Error::Table {
        file: file.display().to_string(),
        detail: detail.into(),
    }
}

fn io_err(path: &Path, e: &std::io::Error) -> Error {
    Error::Io {
        path: path.display().to_string(),
        detail: e.to_string(),
    }
}

/// Where the tensors of a checkpoint live: one file, or an index naming a file per tensor.
enum Source {
    Single(PathBuf),
    Indexed {
        index: PathBuf,
        weight_map: BTreeMap<String, PathBuf>,
    },
}

fn resolve(path: &Path) -> Result<Source> {
    let meta = std::fs::metadata(path).map_err(|e| io_err(path, &e))?;
    if meta.is_dir() {
        let index = path.join(INDEX_FILE);
        if index.is_file() {
            return read_index(&index);
        }
        let single = path.join(SINGLE_FILE);
        if single.is_file() {
            return Ok(Source::Single(single));
        }
        return Err(table_err(
            path,
            format!("directory has neither {INDEX_FILE} nor {SINGLE_FILE}"),
        ));
    }
    if path.extension().is_some_and(|e| e == "json") {
        return read_index(path);
    }
    Ok(Source::Single(path.to_path_buf()))
}

/// Read `model.safetensors.index.json`. Shard paths must stay inside the index's
/// directory: a hostile index may not make us map `/etc/shadow` or `../../x`.
fn read_index(index: &Path) -> Result<Source> {
    let bytes = std::fs::read(index).map_err(|e| io_err(index, &e))?;
    parse_index(index, &bytes)
}

pub(crate) fn parse_index_map(index: &Path, bytes: &[u8]) -> Result<BTreeMap<String, PathBuf>> {
    let value: serde_json::Value = serde_json::from_slice(bytes)
        .map_err(|e| table_err(index, format!("malformed index: {e}")))?;
    let map = value
        .get("weight_map")
        .and_then(|m| m.as_object())
        .ok_or_else(|| table_err(index, "malformed index: no \"weight_map\" object"))?;
    let dir = index.parent().unwrap_or(Path::new(""));
    let mut weight_map = BTreeMap::new();
    for (name, file) in map {
        let Some(file) = file.as_str() else {
            return Err(table_err(
                index,
                format!("malformed index: weight_map[{name:?}] is not a file name"),
            ));
        };
        let rel = Path::new(file);
        let inside = !file.is_empty()
            && rel
                .components()
                .all(|c| matches!(c, Component::Normal(_) | Component::CurDir));
        if !inside {
            return Err(table_err(
                index,
                format!(
                    "weight_map[{name:?}] = {file:?} is not a file inside the checkpoint directory"
                ),
            ));
        }
        weight_map.insert(name.clone(), dir.join(rel));
    }
    Ok(weight_map)
}

fn parse_index(index: &Path, bytes: &[u8]) -> Result<Source> {
    Ok(Source::Indexed {
        index: index.to_path_buf(),
        weight_map: parse_index_map(index, bytes)?,
    })
}

/// Map `path` read-only.
fn map_file(path: &Path) -> Result<MappedFile> {
    let file = File::open(path).map_err(|e| io_err(path, &e))?;
    // SAFETY: a read-only mapping of a checkpoint file. Rust sees it as `&[u8]`, which is
    // sound as long as nobody modifies the file while it is mapped; that is the
    // documented contract of MmapTable (checkpoints are immutable while served). A file
    // that shrinks or fails under the mapping faults the reader: every read of the map
    // is a guarded copy whose faults read zeros and are reported (`sigbus`). Every
    // access is bounds-checked against the mapping's length.
    let map = unsafe { MmapOptions::new().map(&file) }.map_err(|e| io_err(path, &e))?;
    // Read the header without the kernel's read-around: with its default advice, the
    // first fault on a cold file pulled megabytes of tensor data in (the whole of a 16 MiB
    // file, measured). Random access, then the header's pages asked for together.
    // Advisory: errors only cost speed. The table sets its own advice once open.
    if !map.is_empty() {
        let _ = map.advise(memmap2::Advice::Random);
        if let Some(n) = header_len(&map) {
            let _ = map.advise_range(
                memmap2::Advice::WillNeed,
                0,
                n.saturating_add(8).min(map.len()),
            );
        }
    }
    let guard = sigbus::register(map.as_ptr(), map.len(), file.as_raw_fd());
    Ok(MappedFile {
        guard,
        path: path.to_path_buf(),
        file,
        map,
    })
}

/// A header error, in words, with the sizes where the file is cut short.
fn describe(e: &SafeTensorError, bytes: &[u8]) -> String {
    match e {
        SafeTensorError::MetadataIncompleteBuffer => {
            // Say how short (or long): re-read the header alone to learn the data size.
            let expected = header_len(bytes).and_then(|n| {
                let header = bytes.get(8..8usize.checked_add(n)?)?;
                let meta: Metadata = serde_json::from_slice(header).ok()?;
                meta.data_len().checked_add(8)?.checked_add(n)
            });
            match expected {
                Some(want) if want > bytes.len() => format!(
                    "truncated file: the header describes {want} bytes, the file has {}",
                    bytes.len()
                ),
                Some(want) => format!(
                    "file has {} bytes, the header describes {want} (trailing bytes)",
                    bytes.len()
                ),
                None => "the file length does not match its header".to_string(),
            }
        }
        SafeTensorError::HeaderTooSmall => format!(
            "not a safetensors file: {} bytes, too short for a header",
            bytes.len()
        ),
        SafeTensorError::InvalidHeaderLength | SafeTensorError::HeaderTooLarge => {
            let n = header_len(bytes).map_or_else(|| "?".into(), |n| n.to_string());
            format!(
                "malformed header: header length {n} does not fit the file ({} bytes)",
                bytes.len()
            )
        }
        other => format!("malformed header: {other}"),
    }
}

fn header_len(bytes: &[u8]) -> Option<usize> {
    let n: [u8; 8] = bytes.get(..8)?.try_into().ok()?;
    usize::try_from(u64::from_le_bytes(n)).ok()
}

/// A parsed header over a mapped (or in-memory) file.
pub(crate) struct Header {
    pub data_start: usize,
    pub meta: Metadata,
}

/// Parse and validate one file's header with the safetensors crate.
pub(crate) fn read_header(path: &Path, bytes: &[u8]) -> Result<Header> {
    let (n, meta) =
        SafeTensors::read_metadata(bytes).map_err(|e| table_err(path, describe(&e, bytes)))?;
    let data_start = n
        .checked_add(8)
        .ok_or_else(|| table_err(path, "malformed header: length overflows"))?;
    Ok(Header { data_start, meta })
}

/// Match `name` against `prefix{}suffix`: the shard index, or `None`.
fn shard_index(name: &str, prefix: &str, suffix: &str) -> Option<u32> {
    let mid = name.strip_prefix(prefix)?.strip_suffix(suffix)?;
    if mid.is_empty() || mid.len() > 9 || !mid.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    mid.parse().ok()
}

/// The selected tensor names, in shard order.
pub(crate) fn select<'a>(
    where_: &Path,
    names: impl Iterator<Item = &'a str>,
    selector: &Selector,
) -> Result<Vec<String>> {
    match selector {
        Selector::Name(n) => {
            let mut found = false;
            for name in names {
                found |= name == n;
            }
            if found {
                Ok(vec![n.clone()])
            } else {
                Err(table_err(where_, format!("no tensor named {n:?}")))
            }
        }
        Selector::Pattern(p) => {
            let (prefix, suffix) = split_pattern(p)?;
            let mut shards: BTreeMap<u32, String> = BTreeMap::new();
            for name in names {
                let Some(k) = shard_index(name, prefix, suffix) else {
                    continue;
                };
                if let Some(prev) = shards.insert(k, name.to_string()) {
                    return Err(table_err(
                        where_,
                        format!("duplicate shard {k} of {p:?}: {prev:?} and {name:?}"),
                    ));
                }
            }
            if shards.is_empty() {
                return Err(table_err(where_, format!("no tensor matches {p:?}")));
            }
            for (want, &k) in (0u32..).zip(shards.keys()) {
                if k != want {
                    let last = shards.keys().next_back().copied().unwrap_or(k);
                    return Err(table_err(
                        where_,
                        format!(
                            "shard {want} of {p:?} is missing (found {} shards, highest index {last})",
                            shards.len()
                        ),
                    ));
                }
            }
            Ok(shards.into_values().collect())
        }
    }
}

/// `prefix{}suffix` -> `(prefix, suffix)`; exactly one placeholder.
pub(crate) fn split_pattern(p: &str) -> Result<(&str, &str)> {
    let mut parts = p.split(SHARD_PLACEHOLDER);
    match (parts.next(), parts.next(), parts.next()) {
        (Some(prefix), Some(suffix), None) => Ok((prefix, suffix)),
        _ => Err(Error::invalid(format!(
            "pattern {p:?} must contain exactly one {SHARD_PLACEHOLDER} (the shard index)"
        ))),
    }
}

/// Names a scale tensor for `tensor` may have, in the order they are looked for.
pub fn scale_candidates(tensor: &str) -> Vec<String> {
    let mut v = vec![format!("{tensor}_scale"), format!("{tensor}.scale")];
    if let Some(stem) = tensor.strip_suffix(".weight") {
        v.push(format!("{stem}.scale"));
    }
    v
}

/// Read a scalar scale tensor's value.
fn read_scale(path: &Path, name: &str, info: &TensorInfo, data: &[u8]) -> Result<f64> {
    let numel = info.shape.iter().try_fold(1usize, |a, &d| a.checked_mul(d));
    if numel != Some(1) {
        return Err(table_err(
            path,
            format!(
                "scale tensor {name:?} has shape {:?}; only a scalar scale is supported",
                info.shape
            ),
        ));
    }
    let (s, e) = info.data_offsets;
    let bytes = data
        .get(s..e)
        .ok_or_else(|| table_err(path, format!("scale tensor {name:?} lies outside the file")))?;
    let v = match (info.dtype, bytes) {
        (Dtype::F32, &[a, b, c, d]) => f64::from(f32::from_le_bytes([a, b, c, d])),
        (Dtype::F64, &[a, b, c, d, e, f, g, h]) => f64::from_le_bytes([a, b, c, d, e, f, g, h]),
        (Dtype::BF16, &[a, b]) => {
            f64::from(f32::from_bits(u32::from(u16::from_le_bytes([a, b])) << 16))
        }
        (Dtype::F16, &[a, b]) => f16_to_f64(u16::from_le_bytes([a, b])),
        (d, _) => {
            return Err(table_err(
                path,
                format!("scale tensor {name:?} has dtype {d:?}; expected F32, F64, BF16 or F16"),
            ))
        }
    };
    Ok(v)
}

fn f16_to_f64(h: u16) -> f64 {
    let sign = if h & 0x8000 != 0 { -1.0 } else { 1.0 };
    let exp = i32::from((h >> 10) & 0x1f);
    let frac = f64::from(h & 0x3ff);
    match exp {
        0 => sign * frac * 2f64.powi(-24),
        0x1f if frac == 0.0 => sign * f64::INFINITY,
        0x1f => f64::NAN,
        _ => sign * (1.0 + frac / 1024.0) * 2f64.powi(exp - 15),
    }
}

/// Open the checkpoint at `path` and validate the table `selector` names.
pub(crate) fn discover(path: &Path, selector: &Selector) -> Result<Layout> {
    if let Selector::Pattern(p) = selector {
        split_pattern(p)?;
    }
    let source = resolve(path)?;
    let mut files: Vec<MappedFile> = Vec::new();
    let mut headers: Vec<Header> = Vec::new();
    let mut by_path: HashMap<PathBuf, usize> = HashMap::new();

    let mut open =
        |p: &Path, files: &mut Vec<MappedFile>, headers: &mut Vec<Header>| -> Result<usize> {
            // One mapping per file, however the index spells its path.
            let key = std::fs::canonicalize(p).unwrap_or_else(|_| p.to_path_buf());
            if let Some(&i) = by_path.get(&key) {
                return Ok(i);
            }
            let f = map_file(p)?;
            let h = sigbus::guarded(|| read_header(p, &f.map));
            f.check_whole()?;
            let h = h?;
            files.push(f);
            headers.push(h);
            by_path.insert(key, files.len() - 1);
            Ok(files.len() - 1)
        };

    // Which tensors, and which file holds each.
    let (names, owners): (Vec<String>, Vec<usize>) = match &source {
        Source::Single(file) => {
            let i = open(file, &mut files, &mut headers)?;
            let names = select(
                file,
                headers[i].meta.offset_keys().iter().map(String::as_str),
                selector,
            )?;
            let owners = vec![i; names.len()];
            (names, owners)
        }
        Source::Indexed { index, weight_map } => {
            let names = select(index, weight_map.keys().map(String::as_str), selector)?;
            let mut owners = Vec::with_capacity(names.len());
            for n in &names {
                let file = weight_map
                    .get(n)
                    .ok_or_else(|| table_err(index, format!("tensor {n:?} has no file")))?;
                owners.push(open(file, &mut files, &mut headers)?);
            }
            // A selected tensor present in a file the index does not name for it is a
            // duplicate: two sources of truth for the same rows.
            for (fi, h) in headers.iter().enumerate() {
                for (n, &owner) in names.iter().zip(&owners) {
                    if owner != fi && h.meta.info(n).is_some() {
                        return Err(table_err(
                            &files[fi].path,
                            format!(
                                "duplicate tensor {n:?}: also in {} (where the index puts it)",
                                files[owner].path.display()
                            ),
                        ));
                    }
                }
            }
            (names, owners)
        }
    };

    // Each shard: shape, dtype, byte range.
    let mut segments: Vec<Segment> = Vec::with_capacity(names.len());
    let mut first: Option<(Dtype, usize, String)> = None;
    let mut next_row: u64 = 0;
    for (name, &fi) in names.iter().zip(&owners) {
        let path = &files[fi].path;
        let h = &headers[fi];
        let info = h.meta.info(name).ok_or_else(|| {
            table_err(
                path,
                format!("tensor {name:?} is not in this file's header"),
            )
        })?;
        let elem = supported_dtype(info.dtype).ok_or_else(|| {
            table_err(
                path,
                format!(
                    "tensor {name:?} has unsupported dtype {:?} (supported: F8_E4M3, F8_E5M2, BF16, F16, F32)",
                    info.dtype
                ),
            )
        })?;
        let &[rows, cols] = info.shape.as_slice() else {
            return Err(table_err(
                path,
                format!(
                    "tensor {name:?} has shape {:?}; a table is 2-D [rows, cols]",
                    info.shape
                ),
            ));
        };
        if cols == 0 {
            return Err(table_err(
                path,
                format!("tensor {name:?} has zero-width rows"),
            ));
        }
        match &first {
            None => first = Some((info.dtype, cols, name.clone())),
            Some((d, c, n0)) => {
                if *d != info.dtype {
                    return Err(table_err(
                        path,
                        format!(
                            "shard {name:?} is {:?} but shard {n0:?} is {d:?}",
                            info.dtype
                        ),
                    ));
                }
                if *c != cols {
                    return Err(table_err(
                        path,
                        format!("shard {name:?} has {cols} columns but shard {n0:?} has {c}"),
                    ));
                }
            }
        }
        let overflow = || table_err(path, format!("tensor {name:?}: size overflows"));
        let row_bytes = cols.checked_mul(elem).ok_or_else(overflow)?;
        let len = rows.checked_mul(row_bytes).ok_or_else(overflow)?;
        let (s, e) = info.data_offsets;
        let start = h.data_start.checked_add(s).ok_or_else(overflow)?;
        let end = start.checked_add(len).ok_or_else(overflow)?;
        if e.checked_sub(s) != Some(len) || end > files[fi].map.len() {
            return Err(table_err(
                path,
                format!("tensor {name:?}: data range {s}..{e} does not hold {rows} rows of {row_bytes} bytes inside the file"),
            ));
        }
        let rows64 = u64::try_from(rows).map_err(|_| overflow())?;
        segments.push(Segment {
            file: fi,
            tensor: name.clone(),
            first_row: next_row,
            rows: rows64,
            start,
            len,
        });
        next_row = next_row.checked_add(rows64).ok_or_else(overflow)?;
    }
    check_disjoint(&segments, &files)?;

    let Some((dtype, cols, _)) = first else {
        return Err(table_err(
            path,
            format!("no tensor selected by {:?}", selector.text()),
        ));
    };
    let elem = supported_dtype(dtype).unwrap_or(1);
    let row_bytes = cols.saturating_mul(elem);
    if next_row == 0 {
        return Err(table_err(
            &files[segments[0].file].path,
            format!("table {:?} has no rows", selector.text()),
        ));
    }

    // The FP8 scale, where the checkpoint has one.
    let (scale, scale_tensor) = if matches!(dtype, Dtype::F8_E4M3 | Dtype::F8_E5M2) {
        find_scale(&source, &segments, &mut files, &mut headers, &mut open)?
    } else {
        (None, None)
    };

    Ok(Layout {
        files,
        segments,
        dtype,
        cols,
        row_bytes,
        rows: next_row,
        scale,
        scale_tensor,
    })
}

type Opener<'a> = dyn FnMut(&Path, &mut Vec<MappedFile>, &mut Vec<Header>) -> Result<usize> + 'a;

/// One scale for the whole table: every shard has the same scalar scale, or none has.
fn find_scale(
    source: &Source,
    segments: &[Segment],
    files: &mut Vec<MappedFile>,
    headers: &mut Vec<Header>,
    open: &mut Opener<'_>,
) -> Result<(Option<f64>, Option<String>)> {
    let mut found: Vec<Option<(String, f64)>> = Vec::with_capacity(segments.len());
    for seg in segments {
        let mut hit = None;
        for cand in scale_candidates(&seg.tensor) {
            let fi = match source {
                Source::Single(_) => {
                    if headers[seg.file].meta.info(&cand).is_none() {
                        continue;
                    }
                    seg.file
                }
                Source::Indexed { weight_map, .. } => match weight_map.get(&cand) {
                    Some(p) => open(p, files, headers)?,
                    None => continue,
                },
            };
            let path = &files[fi].path;
            let h = &headers[fi];
            let info = h.meta.info(&cand).ok_or_else(|| {
                table_err(
                    path,
                    format!("scale tensor {cand:?} is not in this file's header"),
                )
            })?;
            let data = files[fi].map.get(h.data_start..).unwrap_or(&[]);
            let scale = sigbus::guarded(|| read_scale(path, &cand, info, data));
            files[fi].check_whole()?;
            hit = Some((cand.clone(), scale?));
            break;
        }
        found.push(hit);
    }
    let first_path = &files[segments[0].file].path;
    match found.first() {
        Some(Some((name0, v0))) => {
            for (seg, f) in segments.iter().zip(&found) {
                match f {
                    Some((_, v)) if v.to_bits() == v0.to_bits() => {}
                    Some((n, v)) => {
                        return Err(table_err(
                            first_path,
                            format!("shards have different scales: {n:?} = {v}, {name0:?} = {v0}; open them as separate tables"),
                        ))
                    }
                    None => {
                        return Err(table_err(
                            first_path,
                            format!("shard {:?} has no scale but {name0:?} does", seg.tensor),
                        ))
                    }
                }
            }
            Ok((Some(*v0), Some(name0.clone())))
        }
        _ => {
            if let Some((seg, Some((n, _)))) =
                segments.iter().zip(&found).find(|(_, f)| f.is_some())
            {
                return Err(table_err(
                    first_path,
                    format!(
                        "shard {:?} has a scale ({n:?}) but shard {:?} has none",
                        seg.tensor, segments[0].tensor
                    ),
                ));
            }
            Ok((None, None))
        }
    }
}

/// No two shards may share bytes (the crate's validation already rules this out within a
/// file; this keeps the gather's invariant local and explicit).
fn check_disjoint(segments: &[Segment], files: &[MappedFile]) -> Result<()> {
    let mut spans: Vec<(usize, usize, usize, &str)> = segments
        .iter()
        .map(|s| {
            (
                s.file,
                s.start,
                s.start.saturating_add(s.len),
                s.tensor.as_str(),
            )
        })
        .collect();
    spans.sort_unstable();
    for w in spans.windows(2) {
        let (a, b) = (w[0], w[1]);
        if a.0 == b.0 && b.1 < a.2 && a.1 < a.2 && b.1 < b.2 {
            return Err(table_err(
                &files[a.0].path,
                format!("shards {:?} and {:?} overlap", a.3, b.3),
            ));
        }
    }
    Ok(())
}
