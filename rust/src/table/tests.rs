//! Unit tests of the table: checkpoints built in memory with the safetensors crate's
//! `serialize`, written to a private temp directory.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use proptest::prelude::*;
use safetensors::tensor::TensorView;

use super::*;
use crate::error::ErrorKind;

/// A temp directory removed on drop (no tempfile crate needed).
pub(crate) struct TempDir(PathBuf);

impl TempDir {
    pub fn new() -> Self {
        static N: AtomicU64 = AtomicU64::new(0);
        let p = std::env::temp_dir().join(format!(
            "ple-table-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::create_dir_all(&p).expect("create temp dir");
        Self(p)
    }

    pub fn path(&self) -> &Path {
        &self.0
    }

    pub fn write(&self, name: &str, bytes: &[u8]) -> PathBuf {
        let p = self.0.join(name);
        std::fs::write(&p, bytes).expect("write temp file");
        p
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// One tensor to serialize: name, dtype, shape, raw bytes.
pub(crate) type T = (String, Dtype, Vec<usize>, Vec<u8>);

pub(crate) fn tensor(name: &str, dtype: Dtype, shape: &[usize], seed: u8) -> T {
    let n: usize = shape.iter().product::<usize>() * supported_dtype(dtype).unwrap_or(4);
    let bytes = (0..n)
        .map(|i| {
            (i as u8)
                .wrapping_mul(31)
                .wrapping_add(seed)
                .wrapping_add((i >> 8) as u8)
        })
        .collect();
    (name.to_string(), dtype, shape.to_vec(), bytes)
}

pub(crate) fn scalar_f32(name: &str, v: f32) -> T {
    (
        name.to_string(),
        Dtype::F32,
        vec![],
        v.to_le_bytes().to_vec(),
    )
}

pub(crate) fn st(tensors: &[T]) -> Vec<u8> {
    let views: Vec<(String, TensorView<'_>)> = tensors
        .iter()
        .map(|(n, d, s, b)| {
            (
                n.clone(),
                TensorView::new(*d, s.clone(), b).expect("valid view"),
            )
        })
        .collect();
    safetensors::serialize(views, None).expect("serialize")
}

fn index_json(entries: &[(&str, &str)]) -> Vec<u8> {
    let map: BTreeMap<&str, &str> = entries.iter().copied().collect();
    serde_json::to_vec(&serde_json::json!({"metadata": {}, "weight_map": map})).expect("json")
}

fn open(path: &Path, sel: &Selector) -> Result<MmapTable> {
    MmapTable::open(path, sel, TableOptions::default())
}

fn name(s: &str) -> Selector {
    Selector::Name(s.into())
}

fn pattern(s: &str) -> Selector {
    Selector::Pattern(s.into())
}

/// The reference gather: rows of the concatenated shard bytes.
fn reference(shards: &[&[u8]], row_bytes: usize, ids: &[i64]) -> Vec<u8> {
    let all: Vec<u8> = shards.concat();
    ids.iter()
        .flat_map(|&i| all[i as usize * row_bytes..(i as usize + 1) * row_bytes].to_vec())
        .collect()
}

fn err_of(r: Result<MmapTable>) -> Error {
    match r {
        Ok(t) => panic!("expected an error, opened {t:?}"),
        Err(e) => e,
    }
}

const QWEN: &str = "model.layers.2.ple.ple_embedding.ngram_embedding.shard_{}.weight";

fn qwen(k: usize) -> String {
    QWEN.replace("{}", &k.to_string())
}

#[test]
fn table_is_send_sync_clone() {
    fn check<X: Send + Sync + Clone + 'static>() {}
    check::<MmapTable>();
    fn copy<X: Copy>() {}
    copy::<RowIds<'static>>();
}

#[test]
fn single_tensor_every_dtype() {
    let d = TempDir::new();
    for (dtype, elem) in [
        (Dtype::F8_E4M3, 1),
        (Dtype::F8_E5M2, 1),
        (Dtype::BF16, 2),
        (Dtype::F16, 2),
        (Dtype::F32, 4),
    ] {
        let t = tensor("embed_tokens_per_layer.weight", dtype, &[37, 80], 3);
        let other = tensor("other", Dtype::F32, &[5], 1);
        let p = d.write(&format!("{dtype:?}.safetensors"), &st(&[other, t.clone()]));
        let table = open(&p, &name("embed_tokens_per_layer.weight")).unwrap();
        assert_eq!(table.rows(), 37);
        assert_eq!(table.cols(), 80);
        assert_eq!(table.row_bytes(), 80 * elem);
        assert_eq!(table.dtype_name(), format!("{dtype:?}"));
        assert_eq!(table.scale(), None);
        let ids: Vec<i64> = vec![0, 36, 5, 5, 17, 0];
        let got = table.gather(RowIds::I64(&ids)).unwrap();
        assert_eq!(got, reference(&[&t.3], table.row_bytes(), &ids));
        let ids32: Vec<i32> = ids.iter().map(|&i| i as i32).collect();
        assert_eq!(table.gather(RowIds::I32(&ids32)).unwrap(), got);
    }
}

#[test]
fn pattern_shards_concatenate_in_shard_order() {
    let d = TempDir::new();
    // Stored out of order (and with 10+ shards, so "10" sorts after "9", not after "1").
    let shards: Vec<T> = (0..11)
        .map(|k| tensor(&qwen(k), Dtype::BF16, &[3 + k, 8], k as u8))
        .collect();
    let mut stored = shards.clone();
    stored.reverse();
    stored.push(tensor(
        "model.layers.2.ple.other.weight",
        Dtype::BF16,
        &[2, 8],
        9,
    ));
    let p = d.write("model.safetensors", &st(&stored));
    let table = open(d.path(), &pattern(QWEN)).unwrap();
    let total: usize = (0..11).map(|k| 3 + k).sum();
    assert_eq!(table.rows(), total as u64);
    assert_eq!(table.files(), vec![p.as_path()]);
    let names: Vec<String> = table.shards().iter().map(|s| s.0.to_string()).collect();
    assert_eq!(names, (0..11).map(qwen).collect::<Vec<_>>());
    let ids: Vec<i64> = (0..total as i64).rev().chain([0, 2, 3, 4, 7, 8]).collect();
    let parts: Vec<&[u8]> = shards.iter().map(|t| t.3.as_slice()).collect();
    assert_eq!(
        table.gather(RowIds::I64(&ids)).unwrap(),
        reference(&parts, 16, &ids)
    );
}

#[test]
fn indexed_directory_with_shards_in_two_files() {
    let d = TempDir::new();
    let s0 = tensor(&qwen(0), Dtype::F8_E4M3, &[10, 160], 1);
    let s1 = tensor(&qwen(1), Dtype::F8_E4M3, &[7, 160], 2);
    let s2 = tensor(&qwen(2), Dtype::F8_E4M3, &[5, 160], 3);
    d.write("a.safetensors", &st(std::slice::from_ref(&s1)));
    d.write("b.safetensors", &st(&[s2.clone(), s0.clone()]));
    d.write(
        INDEX_FILE,
        &index_json(&[
            (&qwen(0), "b.safetensors"),
            (&qwen(1), "a.safetensors"),
            (&qwen(2), "b.safetensors"),
        ]),
    );
    let table = open(d.path(), &pattern(QWEN)).unwrap();
    assert_eq!(table.rows(), 22);
    assert_eq!(table.files().len(), 2);
    let ids: Vec<i64> = vec![9, 10, 16, 17, 21, 0, 10, 10];
    let want = reference(&[&s0.3, &s1.3, &s2.3], 160, &ids);
    assert_eq!(table.gather(RowIds::I64(&ids)).unwrap(), want);
    // The index file itself is also accepted as the path.
    let t2 = open(&d.path().join(INDEX_FILE), &pattern(QWEN)).unwrap();
    assert_eq!(t2.gather(RowIds::I64(&ids)).unwrap(), want);
}

#[test]
fn fp8_scale_is_found_and_must_agree() {
    let d = TempDir::new();
    let w = tensor("ple.weight", Dtype::F8_E4M3, &[4, 16], 0);
    for sname in ["ple.weight_scale", "ple.weight.scale", "ple.scale"] {
        let p = d.write("s.safetensors", &st(&[w.clone(), scalar_f32(sname, 0.125)]));
        let t = open(&p, &name("ple.weight")).unwrap();
        assert_eq!(t.scale(), Some(0.125), "{sname}");
        assert_eq!(t.scale_tensor(), Some(sname));
    }
    // A BF16 scale of 2.0 and a [1]-shaped one.
    let bf = (
        "ple.weight_scale".to_string(),
        Dtype::BF16,
        vec![1],
        0x4000u16.to_le_bytes().to_vec(),
    );
    let p = d.write("bf.safetensors", &st(&[w.clone(), bf]));
    assert_eq!(open(&p, &name("ple.weight")).unwrap().scale(), Some(2.0));
    // A per-row scale is not a float: refused, not ignored.
    let rowwise = tensor("ple.weight_scale", Dtype::F32, &[4, 1], 0);
    let p = d.write("r.safetensors", &st(&[w.clone(), rowwise]));
    let e = err_of(open(&p, &name("ple.weight")));
    assert_eq!(e.kind(), ErrorKind::Table);
    assert!(e.to_string().contains("scalar"), "{e}");
    // Shards with different scales.
    let a = tensor("s.0.weight", Dtype::F8_E4M3, &[2, 4], 0);
    let b = tensor("s.1.weight", Dtype::F8_E4M3, &[2, 4], 1);
    let p = d.write(
        "m.safetensors",
        &st(&[
            a.clone(),
            b.clone(),
            scalar_f32("s.0.weight_scale", 1.0),
            scalar_f32("s.1.weight_scale", 2.0),
        ]),
    );
    let e = err_of(open(&p, &pattern("s.{}.weight")));
    assert!(e.to_string().contains("different scales"), "{e}");
    let p = d.write(
        "m2.safetensors",
        &st(&[a.clone(), b.clone(), scalar_f32("s.1.weight_scale", 2.0)]),
    );
    let e = err_of(open(&p, &pattern("s.{}.weight")));
    assert!(e.to_string().contains("has a scale"), "{e}");
    let p = d.write(
        "m3.safetensors",
        &st(&[
            a,
            b,
            scalar_f32("s.0.weight_scale", 0.5),
            scalar_f32("s.1.weight_scale", 0.5),
        ]),
    );
    assert_eq!(
        open(&p, &pattern("s.{}.weight")).unwrap().scale(),
        Some(0.5)
    );
    // A BF16 table never looks for a scale.
    let w16 = tensor("ple.weight", Dtype::BF16, &[4, 16], 0);
    let p = d.write(
        "b16.safetensors",
        &st(&[w16, scalar_f32("ple.weight_scale", 3.0)]),
    );
    assert_eq!(open(&p, &name("ple.weight")).unwrap().scale(), None);
}

#[test]
fn validation_errors_name_file_and_tensor() {
    let d = TempDir::new();
    let good = st(&[tensor("w", Dtype::BF16, &[8, 4], 0)]);
    let p = d.write("good.safetensors", &good);
    let cases: Vec<(Vec<T>, Selector, ErrorKind, &str)> = vec![
        (
            vec![tensor("w", Dtype::BF16, &[8, 4], 0)],
            name("nope"),
            ErrorKind::Table,
            "no tensor named \"nope\"",
        ),
        (
            vec![tensor("w", Dtype::BF16, &[8, 4], 0)],
            pattern("s{}"),
            ErrorKind::Table,
            "no tensor matches",
        ),
        (
            vec![tensor("w", Dtype::BF16, &[8], 0)],
            name("w"),
            ErrorKind::Table,
            "2-D",
        ),
        (
            vec![tensor("w", Dtype::BF16, &[2, 2, 2], 0)],
            name("w"),
            ErrorKind::Table,
            "2-D",
        ),
        (
            vec![tensor("w", Dtype::I32, &[2, 2], 0)],
            name("w"),
            ErrorKind::Table,
            "unsupported dtype I32",
        ),
        (
            vec![tensor("w", Dtype::BF16, &[2, 0], 0)],
            name("w"),
            ErrorKind::Table,
            "zero-width",
        ),
        (
            vec![tensor("w", Dtype::BF16, &[0, 4], 0)],
            name("w"),
            ErrorKind::Table,
            "no rows",
        ),
        (
            vec![
                tensor("s0", Dtype::BF16, &[2, 4], 0),
                tensor("s2", Dtype::BF16, &[2, 4], 0),
            ],
            pattern("s{}"),
            ErrorKind::Table,
            "shard 1 of \"s{}\" is missing",
        ),
        (
            vec![
                tensor("s0", Dtype::BF16, &[2, 4], 0),
                tensor("s1", Dtype::BF16, &[2, 4], 0),
                tensor("s01", Dtype::BF16, &[2, 4], 0),
            ],
            pattern("s{}"),
            ErrorKind::Table,
            "duplicate shard 1",
        ),
        (
            vec![
                tensor("s0", Dtype::BF16, &[2, 4], 0),
                tensor("s1", Dtype::F16, &[2, 4], 0),
            ],
            pattern("s{}"),
            ErrorKind::Table,
            "shard \"s1\" is F16 but shard \"s0\" is BF16",
        ),
        (
            vec![
                tensor("s0", Dtype::BF16, &[2, 4], 0),
                tensor("s1", Dtype::BF16, &[2, 5], 0),
            ],
            pattern("s{}"),
            ErrorKind::Table,
            "has 5 columns",
        ),
        (
            vec![tensor("w", Dtype::BF16, &[2, 4], 0)],
            pattern("w{}{}"),
            ErrorKind::InvalidArgument,
            "exactly one",
        ),
        (
            vec![tensor("w", Dtype::BF16, &[2, 4], 0)],
            pattern("w"),
            ErrorKind::InvalidArgument,
            "exactly one",
        ),
    ];
    for (i, (ts, sel, kind, needle)) in cases.into_iter().enumerate() {
        let f = d.write(&format!("case{i}.safetensors"), &st(&ts));
        let e = err_of(open(&f, &sel));
        assert_eq!(e.kind(), kind, "case {i}: {e}");
        let msg = e.to_string();
        assert!(msg.contains(needle), "case {i}: {msg}");
        if kind == ErrorKind::Table {
            assert!(
                msg.contains(&format!("case{i}.safetensors")),
                "case {i} names no file: {msg}"
            );
        }
    }

    // Truncated, trailing bytes, garbage, empty.
    let cut = d.write("cut.safetensors", &good[..good.len() - 3]);
    let e = err_of(open(&cut, &name("w")));
    assert_eq!(e.kind(), ErrorKind::Table);
    assert!(e.to_string().contains("truncated"), "{e}");
    assert!(e.to_string().contains("cut.safetensors"), "{e}");
    let mut long = good.clone();
    long.extend([0, 0]);
    let e = err_of(open(&d.write("long.safetensors", &long), &name("w")));
    assert!(e.to_string().contains("trailing"), "{e}");
    let e = err_of(open(
        &d.write("junk.safetensors", b"\xff\xff\xff\xff\xff\xff\xff\x7fxx"),
        &name("w"),
    ));
    assert!(e.to_string().contains("malformed header"), "{e}");
    let e = err_of(open(&d.write("empty.safetensors", b""), &name("w")));
    assert!(e.to_string().contains("too short"), "{e}");
    let mut bad_json = good.clone();
    bad_json[8] = b'[';
    let e = err_of(open(&d.write("badjson.safetensors", &bad_json), &name("w")));
    assert!(e.to_string().contains("malformed header"), "{e}");
    // Missing path: an I/O error naming it.
    let e = err_of(open(&d.path().join("absent.safetensors"), &name("w")));
    assert_eq!(e.kind(), ErrorKind::Io);
    assert!(e.to_string().contains("absent.safetensors"), "{e}");
    assert!(open(&p, &name("w")).is_ok());
}

#[test]
fn index_errors() {
    let d = TempDir::new();
    let s0 = tensor("s0", Dtype::BF16, &[2, 4], 0);
    let s1 = tensor("s1", Dtype::BF16, &[2, 4], 1);
    d.write("a.safetensors", &st(std::slice::from_ref(&s0)));
    d.write("b.safetensors", &st(std::slice::from_ref(&s1)));
    let check = |index: &[u8], needle: &str, kind: ErrorKind| {
        d.write(INDEX_FILE, index);
        let e = err_of(open(d.path(), &pattern("s{}")));
        assert_eq!(e.kind(), kind, "{e}");
        assert!(e.to_string().contains(needle), "{needle:?} not in {e}");
    };
    check(b"{not json", "malformed index", ErrorKind::Table);
    check(
        b"{\"weight_map\": 3}",
        "no \"weight_map\"",
        ErrorKind::Table,
    );
    check(
        b"{\"weight_map\": {\"s0\": 7}}",
        "not a file name",
        ErrorKind::Table,
    );
    check(
        &index_json(&[("s0", "../a.safetensors")]),
        "inside the checkpoint",
        ErrorKind::Table,
    );
    check(
        &index_json(&[("s0", "/etc/passwd")]),
        "inside the checkpoint",
        ErrorKind::Table,
    );
    check(
        &index_json(&[("s0", "missing.safetensors")]),
        "missing.safetensors",
        ErrorKind::Io,
    );
    check(
        &index_json(&[("s0", "b.safetensors")]),
        "not in this file's header",
        ErrorKind::Table,
    );
    // s1 is in both files; the index puts it in b.
    d.write("a.safetensors", &st(&[s0.clone(), s1.clone()]));
    check(
        &index_json(&[("s0", "a.safetensors"), ("s1", "b.safetensors")]),
        "duplicate tensor \"s1\"",
        ErrorKind::Table,
    );
    // The same file under two spellings is one file, not a duplicate.
    d.write("a.safetensors", &st(&[s0, s1]));
    d.write(
        INDEX_FILE,
        &index_json(&[("s0", "a.safetensors"), ("s1", "./a.safetensors")]),
    );
    let t = open(d.path(), &pattern("s{}")).unwrap();
    assert_eq!((t.rows(), t.files().len()), (4, 1));
    // A directory with neither index nor model file.
    let empty = TempDir::new();
    let e = err_of(open(empty.path(), &name("w")));
    assert!(e.to_string().contains("neither"), "{e}");
}

#[test]
fn bad_ids_and_destinations_write_nothing() {
    let d = TempDir::new();
    let p = d.write(
        "t.safetensors",
        &st(&[tensor("w", Dtype::F32, &[10, 3], 0)]),
    );
    let t = open(&p, &name("w")).unwrap();
    for (ids, pos, id) in [
        (vec![0i64, 9, 10], 2, 10),
        (vec![-1], 0, -1),
        (vec![3, i64::MIN], 1, i64::MIN),
    ] {
        let mut dst = vec![0xAAu8; ids.len() * 12];
        let e = t.gather_into(RowIds::I64(&ids), &mut dst).unwrap_err();
        match e {
            Error::RowId {
                id: got,
                position,
                rows,
                ref table,
            } => {
                assert_eq!((got, position, rows), (id, pos, 10));
                assert!(table.contains("\"w\""), "{table}");
            }
            other => panic!("{other:?}"),
        }
        assert!(dst.iter().all(|&b| b == 0xAA));
    }
    let mut dst = vec![0xAAu8; 24];
    let e = t.gather_into(RowIds::I32(&[1, -5]), &mut dst).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::RowId);
    assert!(dst.iter().all(|&b| b == 0xAA));
    let e = t
        .gather_into(RowIds::I32(&[1, 2]), &mut dst[..23])
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidArgument);
    t.gather_into(RowIds::I32(&[]), &mut []).unwrap();
}

#[test]
fn parallel_gather_matches_inline() {
    let d = TempDir::new();
    let shards: Vec<T> = (0..3)
        .map(|k| tensor(&format!("s{k}"), Dtype::F8_E4M3, &[1000, 160], k as u8))
        .collect();
    let p = d.write("t.safetensors", &st(&shards));
    let par = MmapTable::open(
        &p,
        &pattern("s{}"),
        TableOptions {
            parallel_min_bytes: 0,
            ..Default::default()
        },
    )
    .unwrap();
    let seq = MmapTable::open(
        &p,
        &pattern("s{}"),
        TableOptions {
            parallel_min_bytes: usize::MAX,
            ..Default::default()
        },
    )
    .unwrap();
    let ids: Vec<i64> = (0..5000).map(|i| (i * 7919) % 3000).collect();
    let a = par.gather(RowIds::I64(&ids)).unwrap();
    let b = seq.gather(RowIds::I64(&ids)).unwrap();
    let parts: Vec<&[u8]> = shards.iter().map(|t| t.3.as_slice()).collect();
    assert_eq!(a, b);
    assert_eq!(a, reference(&parts, 160, &ids));
}

/// A file large enough that page-cache effects are visible, written and synced (clean
/// pages are what POSIX_FADV_DONTNEED can evict).
fn big_table(d: &TempDir, rows: usize) -> PathBuf {
    let t = tensor("w", Dtype::BF16, &[rows, 128], 7);
    let p = d.write("big.safetensors", &st(&[t]));
    std::fs::File::open(&p)
        .and_then(|f| f.sync_all())
        .expect("sync");
    p
}

#[test]
fn prewarm_raises_residency_and_drop_lowers_it() {
    let d = TempDir::new();
    let p = big_table(&d, 16384); // 4 MiB
    let t = open(&p, &name("w")).unwrap();
    let total = t.data_bytes();
    t.drop_pages().unwrap();
    let cold = t.resident_bytes().unwrap();
    assert!(cold < total / 4, "after drop: {cold} of {total} resident");
    assert_eq!(t.prewarm(total / 2).unwrap(), total / 2);
    let half = t.resident_bytes().unwrap();
    assert!(
        half >= total / 2 && half > cold,
        "after prewarm(half): {half} of {total}"
    );
    assert_eq!(t.prewarm(u64::MAX).unwrap(), total);
    assert!(t.resident_bytes().unwrap() >= total);
    t.drop_pages().unwrap();
    let dropped = t.resident_bytes().unwrap();
    assert!(dropped < total / 4, "after drop: {dropped} of {total}");
    // Prewarm at open.
    let t2 = MmapTable::open(
        &p,
        &name("w"),
        TableOptions {
            prewarm_bytes: Some(total),
            ..Default::default()
        },
    )
    .unwrap();
    assert!(t2.resident_bytes().unwrap() >= total);
}

fn with(opts: TableOptions, p: &Path, sel: &Selector) -> MmapTable {
    MmapTable::open(p, sel, opts).unwrap()
}

const ALL_WAYS: [ColdReads; 5] = [
    ColdReads::Auto,
    ColdReads::Uring,
    ColdReads::WillNeed,
    ColdReads::Pool,
    ColdReads::Fault,
];

/// Ways usable here: `Uring` only where the kernel allows io_uring.
fn ways() -> Vec<ColdReads> {
    ALL_WAYS
        .into_iter()
        .filter(|&w| w != ColdReads::Uring || coldread::uring_unavailable().is_none())
        .collect()
}

#[test]
fn every_cold_way_gathers_the_reference_rows() {
    let d = TempDir::new();
    // Three shards in two files; 160 B rows straddle pages; odd widths too.
    for (dtype, cols) in [(Dtype::F8_E4M3, 160), (Dtype::F32, 3), (Dtype::BF16, 4000)] {
        let shards: Vec<T> = (0..3)
            .map(|k| tensor(&qwen(k), dtype, &[700 + k * 13, cols], k as u8))
            .collect();
        let f0 = d.write(
            "a.safetensors",
            &st(&[shards[0].clone(), shards[2].clone()]),
        );
        let f1 = d.write("b.safetensors", &st(&[shards[1].clone()]));
        for f in [&f0, &f1] {
            std::fs::File::open(f).and_then(|f| f.sync_all()).unwrap();
        }
        let idx = d.write(
            INDEX_FILE,
            &index_json(&[
                (&qwen(0), "a.safetensors"),
                (&qwen(1), "b.safetensors"),
                (&qwen(2), "a.safetensors"),
            ]),
        );
        let rb = cols * supported_dtype(dtype).unwrap();
        let parts: Vec<&[u8]> = shards.iter().map(|t| t.3.as_slice()).collect();
        let rows = (700 + 713 + 726) as i64;
        let ids64: Vec<i64> = (0..300)
            .map(|i| (i * 7919 + 13) % rows)
            .chain([0, rows - 1, 5, 5, 699, 700, 1412, 1413])
            .collect();
        let ids32: Vec<i32> = ids64.iter().map(|&i| i as i32).collect();
        let want = reference(&parts, rb, &ids64);
        for way in ways() {
            for access in [Access::Random, Access::Normal] {
                let t = with(
                    TableOptions {
                        cold_reads: way,
                        access,
                        ..Default::default()
                    },
                    &idx,
                    &pattern(QWEN),
                );
                assert_ne!(t.cold_reads().0, ColdReads::Auto);
                t.drop_pages().unwrap();
                // Cold, then partly warm (half the ids again plus new ones), then warm.
                assert_eq!(t.gather(RowIds::I64(&ids64)).unwrap(), want, "{way:?} cold");
                let s = t.page_stats();
                assert_eq!(s.row_misses + s.row_hits, ids64.len() as u64);
                assert!(s.pages_read > 0 && s.touched_bytes > 0, "{s:?}");
                assert_eq!(t.gather(RowIds::I32(&ids32)).unwrap(), want, "{way:?} warm");
                let s2 = t.page_stats();
                assert_eq!(s2.row_misses, s.row_misses, "{way:?}: a warm gather read");
                assert_eq!(s2.row_hits, s.row_hits + ids64.len() as u64);
                t.drop_pages().unwrap();
                assert_eq!(t.page_stats().touched_bytes, 0);
                let mut dst = vec![0u8; 2 * rb];
                t.gather_into(RowIds::I64(&ids64[..2]), &mut dst).unwrap();
                assert_eq!(dst, reference(&parts, rb, &ids64[..2]));
            }
        }
        // Cached by another reader: a new table adopts every shard's pages (shards share
        // a file and its boundary pages) and reads no row cold.
        for f in [&f0, &f1] {
            std::fs::read(f).unwrap();
        }
        let t = with(TableOptions::default(), &idx, &pattern(QWEN));
        assert!(t.page_stats().touched_bytes >= t.data_bytes(), "{dtype:?}");
        assert_eq!(
            t.gather(RowIds::I64(&ids64)).unwrap(),
            want,
            "{dtype:?} adopted"
        );
        assert_eq!(
            t.page_stats().row_misses,
            0,
            "{dtype:?}: a cached row read cold"
        );
    }
}

#[test]
fn a_cold_row_reads_its_own_pages_only() {
    let d = TempDir::new();
    let p = big_table(&d, 1 << 16); // 16 MiB, 256 B rows
    let ps = pagecache::page_size() as u64;
    for way in ways() {
        let t = with(
            TableOptions {
                cold_reads: way,
                ..Default::default()
            },
            &p,
            &name("w"),
        );
        t.drop_pages().unwrap();
        let before = t.resident_bytes().unwrap();
        let ids: Vec<i64> = (0..32).map(|i| i * 2011 + 7).collect();
        t.gather(RowIds::I64(&ids)).unwrap();
        let grown = t.resident_bytes().unwrap() - before;
        // One page a row (a row straddling two pages may take both).
        assert!(
            grown <= 2 * ps * ids.len() as u64,
            "{way:?}: {} pages for {} rows",
            grown / ps,
            ids.len()
        );
        assert!(grown >= ps * ids.len() as u64 / 2, "{way:?}: {grown}");
    }
}

#[test]
fn pages_in_the_page_cache_are_adopted_at_open() {
    let d = TempDir::new();
    let p = big_table(&d, 1 << 14); // 4 MiB, 256 B rows
    let data = tensor("w", Dtype::BF16, &[1 << 14, 128], 7).3;
    let ids: Vec<i64> = (0..200).map(|i| (i * 7919 + 3) % (1 << 14)).collect();
    let want = reference(&[&data], 256, &ids);
    let cold = |t: &MmapTable| {
        t.drop_pages().unwrap();
        assert_eq!(
            t.resident_bytes().unwrap(),
            0,
            "pages must be able to leave the cache"
        );
    };
    cold(&with(TableOptions::default(), &p, &name("w")));
    // Cached by another reader (nothing mapped).
    std::fs::read(&p).unwrap();
    for way in ways() {
        let opts = TableOptions {
            cold_reads: way,
            ..Default::default()
        };
        let t = with(opts.clone(), &p, &name("w"));
        let s = t.page_stats();
        assert!(
            s.pages_adopted > 0 && s.touched_bytes >= t.data_bytes(),
            "{way:?} {s:?}"
        );
        assert_eq!(t.gather(RowIds::I64(&ids)).unwrap(), want, "{way:?}");
        let s = t.page_stats();
        assert_eq!((s.row_hits, s.row_misses), (ids.len() as u64, 0), "{way:?}");
        assert_eq!(t.adopt_resident().unwrap(), 0, "{way:?}: adopted twice");
        drop(t);
        let off = with(
            TableOptions {
                adopt_resident: false,
                ..opts.clone()
            },
            &p,
            &name("w"),
        );
        assert_eq!(off.gather(RowIds::I64(&ids)).unwrap(), want, "{way:?}");
        let s = off.page_stats();
        assert_eq!(s.pages_adopted, 0);
        assert!(s.row_misses > 0, "{way:?}: {s:?}");
        let budget = with(
            TableOptions {
                rss_budget_bytes: Some(1 << 20),
                ..opts
            },
            &p,
            &name("w"),
        );
        assert_eq!(
            budget.page_stats().pages_adopted,
            0,
            "{way:?}: adopted under a budget"
        );
    }
}

#[test]
fn rss_budget_keeps_hot_pages_and_evicts_cold_ones() {
    let d = TempDir::new();
    let p = big_table(&d, 1 << 16); // 16 MiB, 256 B rows: 16 rows a page
    let ps = pagecache::page_size();
    let budget = 256 * ps as u64; // 1 MiB
    let t = with(
        TableOptions {
            rss_budget_bytes: Some(budget),
            ..Default::default()
        },
        &p,
        &name("w"),
    );
    t.drop_pages().unwrap();
    // The reference comes from the bytes written, not from a second table: pages another
    // mapping holds cannot leave the page cache, which would blur the residency checks.
    let data = tensor("w", Dtype::BF16, &[1 << 16, 128], 7).3;
    let want = |ids: &[i64]| reference(&[&data], 256, ids);
    let row_of_page = |pg: i64| pg * 16 + (pg % 16);
    let hot: Vec<i64> = (0..64).map(|pg| row_of_page(pg * 3)).collect();
    // Under budget: nothing evicted.
    t.gather(RowIds::I64(&hot)).unwrap();
    assert_eq!(t.page_stats().budget_drops, 0);
    let mut misses_on_hot = 0;
    for round in 0..40i64 {
        // The hot rows every round, then 50 pages never seen before.
        let before = t.page_stats().row_misses;
        assert_eq!(t.gather(RowIds::I64(&hot)).unwrap(), want(&hot));
        if round >= 2 {
            misses_on_hot += t.page_stats().row_misses - before;
        }
        let fresh: Vec<i64> = (0..50).map(|k| row_of_page(200 + round * 50 + k)).collect();
        assert_eq!(t.gather(RowIds::I64(&fresh)).unwrap(), want(&fresh));
        let s = t.page_stats();
        assert!(s.touched_bytes <= budget, "round {round}: {s:?}");
    }
    let s = t.page_stats();
    assert!(s.budget_drops > 0 && s.last_drop_error.is_none(), "{s:?}");
    assert!(s.pages_evicted >= 40 * 50 + 64 - 256, "{s:?}");
    assert_eq!(misses_on_hot, 0, "hot pages were evicted: {s:?}");
    // The page cache holds about the budget (the kernel may keep a neighbour or two).
    let resident = t.resident_bytes().unwrap();
    assert!(
        resident <= budget + 16 * ps as u64,
        "{resident} resident with a budget of {budget}"
    );
    // Prewarm is capped by the budget.
    assert_eq!(t.prewarm(u64::MAX).unwrap(), budget);
    assert!(t.page_stats().touched_bytes <= budget);
}

#[test]
fn options_parse_and_conflicts_are_refused() {
    for w in ALL_WAYS {
        assert_eq!(ColdReads::parse(w.name()).unwrap(), w);
    }
    for a in [Access::Random, Access::Normal] {
        assert_eq!(Access::parse(a.name()).unwrap(), a);
    }
    assert_eq!(
        ColdReads::parse("io_uring").unwrap_err().kind(),
        ErrorKind::InvalidArgument
    );
    assert_eq!(
        Access::parse("seq").unwrap_err().kind(),
        ErrorKind::InvalidArgument
    );
    let d = TempDir::new();
    let p = d.write(
        "t.safetensors",
        &st(&[tensor("w", Dtype::F32, &[10, 3], 0)]),
    );
    let e = MmapTable::open(
        &p,
        &name("w"),
        TableOptions {
            readahead: true,
            cold_reads: ColdReads::Fault,
            ..Default::default()
        },
    )
    .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidArgument);
    // readahead=true is accepted otherwise (cold reads are batched anyway).
    let t = with(
        TableOptions {
            readahead: true,
            ..Default::default()
        },
        &p,
        &name("w"),
    );
    assert_eq!(t.gather(RowIds::I64(&[9])).unwrap().len(), 12);
}

/// A read error comes back typed from the ways that read through the descriptor (a file
/// cut short under the table stands in for a failing device; through the mapping the
/// same would be SIGBUS, which is why those ways are not exercised here).
#[test]
fn cold_read_errors_are_typed() {
    for way in [ColdReads::Uring, ColdReads::Pool] {
        if !ways().contains(&way) {
            continue;
        }
        let d = TempDir::new();
        let p = big_table(&d, 4096); // 1 MiB
        let t = with(
            TableOptions {
                cold_reads: way,
                ..Default::default()
            },
            &p,
            &name("w"),
        );
        t.drop_pages().unwrap();
        let len = std::fs::metadata(&p).unwrap().len();
        std::fs::OpenOptions::new()
            .write(true)
            .open(&p)
            .and_then(|f| f.set_len(len / 2))
            .unwrap();
        let mut dst = vec![0u8; 2 * 256];
        let e = t
            .gather_into(RowIds::I64(&[1, 4000]), &mut dst)
            .unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Io, "{way:?}: {e}");
        assert!(e.to_string().contains("offset"), "{e}");
        // Rows before the cut still read.
        t.gather_into(RowIds::I64(&[1, 2]), &mut dst).unwrap();
    }
}

/// A file cut short under the table, read through the mapping: every way, with the rows'
/// pages known resident or evicted, inline and on the gather pool. The lost rows are a
/// typed error naming the file and offset, the destination is zeroed, rows still inside
/// the file keep reading, and the lost ones keep failing.
#[test]
fn a_file_truncated_under_the_table_is_a_typed_error_on_every_way() {
    for way in ways() {
        for evict in [false, true] {
            for parallel in [usize::MAX, 0] {
                let d = TempDir::new();
                let p = big_table(&d, 16384); // 4 MiB, 256 B rows
                let bytes = std::fs::read(&p).unwrap();
                let t = with(
                    TableOptions {
                        cold_reads: way,
                        parallel_min_bytes: parallel,
                        ..Default::default()
                    },
                    &p,
                    &name("w"),
                );
                let ids: Vec<i64> = vec![10, 16000, 11, 15000];
                let mut dst = vec![0u8; ids.len() * 256];
                t.gather_into(RowIds::I64(&ids), &mut dst).unwrap();
                let want = t.gather(RowIds::I64(&[10, 11])).unwrap();
                if evict {
                    t.drop_pages().unwrap();
                }
                std::fs::OpenOptions::new()
                    .write(true)
                    .open(&p)
                    .and_then(|f| f.set_len(16 << 10))
                    .unwrap();
                let case = format!("{way:?} evict={evict} parallel_min={parallel}");
                for _ in 0..2 {
                    dst.fill(0xAB);
                    let e = t.gather_into(RowIds::I64(&ids), &mut dst).unwrap_err();
                    assert_eq!(e.kind(), ErrorKind::Io, "{case}: {e}");
                    let msg = e.to_string();
                    assert!(
                        msg.contains("offset") && msg.contains(&p.display().to_string()),
                        "{case}: {msg}"
                    );
                    assert!(dst.iter().all(|&b| b == 0), "{case}: rows left in dst");
                    let e = t.gather(RowIds::I32(&[16000])).unwrap_err();
                    assert_eq!(e.kind(), ErrorKind::Io, "{case}: {e}");
                }
                // Rows inside what is left of the file: the bytes they had.
                let got = t.gather(RowIds::I64(&[10, 11])).unwrap();
                assert_eq!(got, want, "{case}");
                assert_eq!(
                    &got[..256],
                    &bytes[bytes.len() - 16384 * 256 + 10 * 256..][..256]
                );
            }
        }
    }
}

/// Prewarming a table whose file was cut short fails typed instead of SIGBUS.
#[test]
fn prewarm_of_a_truncated_file_is_a_typed_error() {
    let d = TempDir::new();
    let p = big_table(&d, 16384);
    let t = open(&p, &name("w")).unwrap();
    std::fs::OpenOptions::new()
        .write(true)
        .open(&p)
        .and_then(|f| f.set_len(64 << 10))
        .unwrap();
    let e = t.prewarm(u64::MAX).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Io, "{e}");
    t.gather(RowIds::I64(&[1])).unwrap();
    assert_eq!(
        t.gather(RowIds::I64(&[16383])).unwrap_err().kind(),
        ErrorKind::Io
    );
}

/// Mutate a valid checkpoint at random; opening must return a typed error or a valid
/// table, never panic, and any table it opens must gather in bounds.
fn open_any(bytes: &[u8], d: &TempDir, sel: &Selector) {
    let p = d.write("fuzz.safetensors", bytes);
    if let Ok(t) = open(&p, sel) {
        let n = t.rows();
        let ids = [0, n as i64 - 1, n as i64, -1];
        let _ = t.gather(RowIds::I64(&ids));
        let ok = t.gather(RowIds::I64(&ids[..2])).unwrap();
        assert_eq!(ok.len(), 2 * t.row_bytes());
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn hostile_headers_never_panic(
        edits in proptest::collection::vec((any::<usize>(), any::<u8>()), 0..8),
        cut in proptest::option::of(any::<usize>()),
        header_len in proptest::option::of(any::<u64>()),
        shards in 1usize..4,
    ) {
        let d = TempDir::new();
        let mut ts: Vec<T> = (0..shards).map(|k| tensor(&format!("s{k}"), Dtype::BF16, &[3, 4], k as u8)).collect();
        ts.push(scalar_f32("s0_scale", 1.0));
        let mut bytes = st(&ts);
        // Edits land mostly in the header, where the parser is.
        let hl = 8 + u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
        for (pos, b) in edits {
            let i = if pos % 4 == 0 { pos % bytes.len() } else { pos % hl };
            bytes[i] = b;
        }
        if let Some(n) = header_len {
            bytes[..8].copy_from_slice(&n.to_le_bytes());
        }
        if let Some(c) = cut {
            bytes.truncate(c % (bytes.len() + 1));
        }
        open_any(&bytes, &d, &pattern("s{}"));
        open_any(&bytes, &d, &name("s0"));
    }

    #[test]
    fn gather_matches_reference(
        rows in proptest::collection::vec(1usize..40, 1..5),
        // F16 rows of 2-46 B, and 500-524 B and 10.5-10.6 KiB: either side of the part
        // of a row the gather prefetches (512 B), and a whole Gemma token's width.
        cols in prop_oneof![1usize..24, 250usize..262, 5370usize..5390],
        ids in proptest::collection::vec(any::<u32>(), 0..300),
        mode in 0u8..3,
    ) {
        let d = TempDir::new();
        let ts: Vec<T> = rows.iter().enumerate().map(|(k, &r)| tensor(&format!("p.{k}.w"), Dtype::F16, &[r, cols], k as u8)).collect();
        let p = d.write("t.safetensors", &st(&ts));
        // Inline, the shared pool, and a pool of the table's own.
        let opts = TableOptions {
            parallel_min_bytes: if mode == 0 { usize::MAX } else { 0 },
            gather_threads: (mode == 2).then_some(2),
            ..Default::default()
        };
        let t = MmapTable::open(&p, &pattern("p.{}.w"), opts).unwrap();
        let total: usize = rows.iter().sum();
        let ids: Vec<i64> = ids.iter().map(|&i| i64::from(i) % total as i64).collect();
        let parts: Vec<&[u8]> = ts.iter().map(|t| t.3.as_slice()).collect();
        prop_assert_eq!(t.gather(RowIds::I64(&ids)).unwrap(), reference(&parts, cols * 2, &ids));
    }

    #[test]
    fn a_column_window_gathers_the_window_of_each_row(
        rows in proptest::collection::vec(1usize..40, 1..4),
        // F16 rows: narrow ones, a Gemma token's width, and widths whose windows take the
        // fixed-size copies (80 and 160 columns: 160 and 320 B).
        cols in prop_oneof![1usize..24, 160usize..170, 5370usize..5390],
        window in (any::<u16>(), any::<u16>()),
        ids in proptest::collection::vec(any::<u32>(), 0..200),
        mode in 0u8..4,
    ) {
        let d = TempDir::new();
        let ts: Vec<T> = rows.iter().enumerate().map(|(k, &r)| tensor(&format!("p.{k}.w"), Dtype::F16, &[r, cols], k as u8)).collect();
        let p = d.write("t.safetensors", &st(&ts));
        let first = usize::from(window.0) % cols;
        let count = match usize::from(window.1) % 3 {
            0 => (cols - first).min(80),
            1 => (cols - first).min(160),
            _ => 1 + usize::from(window.1) % (cols - first),
        };
        // Inline, the shared pool, a pool of the table's own, and the cold path (pages
        // not adopted: every row read cold first).
        let opts = TableOptions {
            parallel_min_bytes: if mode == 0 { usize::MAX } else { 0 },
            gather_threads: (mode == 2).then_some(2),
            adopt_resident: mode != 3,
            columns: Some((first, count)),
            ..Default::default()
        };
        let t = MmapTable::open(&p, &pattern("p.{}.w"), opts).unwrap();
        prop_assert_eq!((t.cols(), t.row_bytes()), (count, count * 2));
        let total: usize = rows.iter().sum();
        let ids: Vec<i64> = ids.iter().map(|&i| i64::from(i) % total as i64).collect();
        let parts: Vec<&[u8]> = ts.iter().map(|t| t.3.as_slice()).collect();
        let whole = reference(&parts, cols * 2, &ids);
        let want: Vec<u8> = whole
            .chunks_exact(cols * 2)
            .flat_map(|row| row[first * 2..(first + count) * 2].iter().copied())
            .collect();
        prop_assert_eq!(t.gather(RowIds::I64(&ids)).unwrap(), want);
    }
}

#[test]
fn a_column_window_outside_the_row_is_refused() {
    let d = TempDir::new();
    let t = tensor("w", Dtype::BF16, &[8, 6], 1);
    let p = d.write("t.safetensors", &st(std::slice::from_ref(&t)));
    for bad in [
        (0, 0),
        (6, 1),
        (0, 7),
        (5, 2),
        (usize::MAX, 2),
        (1, usize::MAX),
    ] {
        let opts = TableOptions {
            columns: Some(bad),
            ..Default::default()
        };
        let e = MmapTable::open(&p, &name("w"), opts).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidArgument, "{bad:?}: {e}");
        assert!(e.to_string().contains("6 columns"), "{e}");
    }
    let opts = TableOptions {
        columns: Some((5, 1)),
        ..Default::default()
    };
    let w = MmapTable::open(&p, &name("w"), opts).unwrap();
    assert_eq!((w.cols(), w.row_bytes(), w.rows()), (1, 2, 8));
    assert!(w.label().contains("columns 5..6"), "{}", w.label());
    let rows = w.gather(RowIds::I64(&[7, 0])).unwrap();
    assert_eq!(
        rows,
        [&t.3[7 * 12 + 10..7 * 12 + 12], &t.3[10..12]].concat()
    );
}

#[test]
fn a_window_shares_the_tables_mapping_and_counters() {
    let d = TempDir::new();
    let t = tensor("w", Dtype::BF16, &[64, 6], 2);
    let p = d.write("t.safetensors", &st(std::slice::from_ref(&t)));
    let base = MmapTable::open(&p, &name("w"), TableOptions::default()).unwrap();
    let rest = base.window(Some((1, 5)), Some(2)).unwrap();
    let first = rest.window(Some((0, 1)), None).unwrap(); // columns of the stored row
    assert_eq!((rest.cols(), rest.row_bytes(), first.cols()), (5, 10, 1));
    assert_eq!(rest.options().gather_threads, Some(2));
    assert_eq!(base.options().gather_threads, None);
    assert_eq!(rest.options().columns, Some((1, 5)));
    assert!(rest.label().contains("columns 1..6"), "{}", rest.label());
    let ids = [63i64, 0, 7, 7];
    let hits = base.page_stats().row_hits;
    let got = rest.gather(RowIds::I64(&ids)).unwrap();
    let want: Vec<u8> = ids
        .iter()
        .flat_map(|&i| t.3[i as usize * 12 + 2..i as usize * 12 + 12].to_vec())
        .collect();
    assert_eq!(got, want);
    assert_eq!(base.page_stats().row_hits, hits + 4, "one table's counters");
    drop(base);
    assert_eq!(
        first.gather(RowIds::I64(&[1])).unwrap(),
        t.3[12..14].to_vec()
    );
    for bad in [Some((6, 1)), Some((0, 0))] {
        let e = rest.window(bad, None).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidArgument, "{e}");
    }
    let e = rest.window(None, Some(1)).unwrap_err();
    assert!(e.to_string().contains("gather_threads"), "{e}");
}

#[test]
fn a_table_of_its_own_threads_gathers_beside_the_shared_pool() {
    let d = TempDir::new();
    let (rows, cols) = (4096usize, 64usize);
    let t = tensor("w", Dtype::F16, &[rows, cols], 3);
    let p = d.write("t.safetensors", &st(std::slice::from_ref(&t)));
    for bad in [0usize, 1, MAX_GATHER_THREADS + 1] {
        let opts = TableOptions {
            gather_threads: Some(bad),
            ..Default::default()
        };
        let e = MmapTable::open(&p, &name("w"), opts).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidArgument, "{e}");
        assert!(e.to_string().contains("gather_threads"), "{e}");
    }
    let own = TableOptions {
        gather_threads: Some(3),
        parallel_min_bytes: 0,
        ..Default::default()
    };
    let shared = TableOptions {
        parallel_min_bytes: 0,
        ..Default::default()
    };
    let a = with(own, &p, &name("w"));
    let b = with(shared, &p, &name("w"));
    let ids: Vec<i64> = (0..rows as i64).map(|i| (i * 7919) % rows as i64).collect();
    let want = reference(&[t.3.as_slice()], cols * 2, &ids);
    // The worker keeps a table's own threads awake only for gathers that would use them.
    assert_eq!(a.own_pool_for(2).map(|p| p.current_num_threads()), Some(3));
    assert!(a.own_pool_for(1).is_none(), "one row is copied inline");
    assert!(
        b.own_pool_for(rows).is_none(),
        "the shared pool is not the table's own"
    );
    let c = with(
        TableOptions {
            gather_threads: Some(2),
            ..Default::default()
        },
        &p,
        &name("w"),
    );
    let min_rows = PARALLEL_MIN_BYTES / (cols * 2);
    assert!(c.own_pool_for(min_rows).is_some());
    assert!(c.own_pool_for(min_rows - 1).is_none());
    // Both at once from several threads: every gather is the reference's bytes.
    std::thread::scope(|sc| {
        for table in [&a, &b, &a, &b] {
            let (ids, want) = (&ids, &want);
            sc.spawn(move || {
                for _ in 0..20 {
                    assert_eq!(&table.gather(RowIds::I64(ids)).unwrap(), want);
                }
            });
        }
    });
}

/// Inline vs pool gather times on a resident table; how PARALLEL_MIN_BYTES was chosen.
/// `cargo test --release -- --ignored --nocapture gather_timings`
#[test]
#[ignore = "timing measurement, run by hand in release mode"]
fn gather_timings() {
    use std::time::Instant;
    let d = TempDir::new();
    for row_bytes in [160usize, 320] {
        let rows = 1 << 20;
        let t = tensor("w", Dtype::F8_E4M3, &[rows, row_bytes], 1);
        let p = d.write(&format!("t{row_bytes}.safetensors"), &st(&[t]));
        let mk = |min| {
            MmapTable::open(
                &p,
                &name("w"),
                TableOptions {
                    parallel_min_bytes: min,
                    ..Default::default()
                },
            )
            .unwrap()
        };
        let (seq, par) = (mk(usize::MAX), mk(0));
        seq.prewarm(u64::MAX).unwrap();
        println!("row_bytes={row_bytes}  (median ns over 2000 reps, 8 rotating id sets)");
        println!(
            "{:>8} {:>10} {:>10} {:>10}",
            "rows", "bytes", "inline", "pool"
        );
        for n in [16usize, 64, 256, 512, 1024, 2048, 4096, 8192, 16384] {
            let sets: Vec<Vec<i64>> = (0..8u64)
                .map(|s| {
                    (0..n as u64)
                        .map(|i| ((i * 2654435761 + s * 97) % rows as u64) as i64)
                        .collect()
                })
                .collect();
            let mut dst = vec![0u8; n * row_bytes];
            let med = |t: &MmapTable, dst: &mut [u8]| {
                let mut v: Vec<u128> = (0..2000)
                    .map(|r| {
                        let t0 = Instant::now();
                        t.gather_into(RowIds::I64(&sets[r % 8]), dst).unwrap();
                        t0.elapsed().as_nanos()
                    })
                    .collect();
                v.sort_unstable();
                v[v.len() / 2]
            };
            let a = med(&seq, &mut dst);
            let b = med(&par, &mut dst);
            println!("{n:>8} {:>10} {a:>10} {b:>10}", n * row_bytes);
        }
    }
}

#[test]
#[ignore = "timing measurement, run by hand in release mode"]
fn warm_check_cost() {
    use std::time::Instant;
    let d = TempDir::new();
    let rows = 1 << 20;
    for row_bytes in [160usize, 320] {
        let t = tensor("w", Dtype::F8_E4M3, &[rows, row_bytes], 1);
        let p = d.write(&format!("t{row_bytes}.safetensors"), &st(&[t]));
        let t = MmapTable::open(
            &p,
            &name("w"),
            TableOptions {
                parallel_min_bytes: usize::MAX,
                ..Default::default()
            },
        )
        .unwrap();
        // All but the last rows' pages known: the per-row check runs.
        t.prewarm(t.data_bytes() - 3 * 4096).unwrap();
        for n in [16usize, 256, 4096] {
            let sets: Vec<Vec<i64>> = (0..16u64)
                .map(|s| {
                    (0..n as u64)
                        .map(|i| ((i * 2654435761 + s * 977) % (rows as u64 - 100)) as i64)
                        .collect()
                })
                .collect();
            let mut dst = vec![0u8; n * row_bytes];
            let src = t.mapped_rows();
            let mut a = vec![];
            let mut b = vec![];
            let mut c = vec![];
            let check = t.inner.pages.single_segment_check(row_bytes).unwrap();
            for r in 0..6000 {
                let ids = &sets[r % 16];
                if r % 3 == 0 {
                    let t0 = Instant::now();
                    t.gather_into(RowIds::I64(ids), &mut dst).unwrap();
                    a.push(t0.elapsed().as_nanos());
                } else if r % 3 == 1 {
                    let t0 = Instant::now();
                    src.copy_if(ids, &mut dst, &|_, _| true);
                    b.push(t0.elapsed().as_nanos());
                } else {
                    let t0 = Instant::now();
                    assert_eq!(
                        src.copy_if(ids, &mut dst, &check),
                        super::gather::Copied::All
                    );
                    c.push(t0.elapsed().as_nanos());
                }
            }
            a.sort_unstable();
            b.sort_unstable();
            c.sort_unstable();
            println!(
                "{row_bytes} {n}: gather_into {} ns, bare copy {} ns, copy+check {} ns",
                a[a.len() / 2],
                b[b.len() / 2],
                c[c.len() / 2]
            );
        }
    }
}

/// Drop the table's pages (its own drop, as the kernel's reclaim would); whether they left.
fn drop_cached(t: &MmapTable) -> bool {
    t.drop_pages().unwrap();
    t.resident_bytes().unwrap() < t.data_bytes() / 8
}

#[test]
fn a_copy_that_runs_slow_stops_only_where_its_pages_are_not_cached() {
    use super::gather::Copied;
    let d = TempDir::new();
    let p = big_table(&d, 4096); // 1 MiB, 256 B rows: 16 a page
    let t = open(&p, &name("w")).unwrap();
    let src = t.mapped_rows();
    // Rows 4 pages apart: each its own page.
    let ids: Vec<i64> = (0..64).map(|i| (i * 64) % 4096).collect();
    let mut dst = vec![0u8; ids.len() * src.row_bytes];
    assert_eq!(src.copy_if(&ids, &mut dst, &|_, _| true), Copied::All);
    let first = std::sync::atomic::AtomicBool::new(true);
    let once = |_: usize, _: usize| first.swap(false, Ordering::Relaxed);
    assert_eq!(src.copy_if(&ids, &mut dst, &once), Copied::Unknown);
    // Each row taking 60 us, as a page read from storage would, its pages cached (they
    // were just copied): a slow thread, not a fault storm. The copy goes on.
    let slow = |_: usize, _: usize| {
        std::thread::sleep(std::time::Duration::from_micros(60));
        true
    };
    assert_eq!(src.copy_if(&ids, &mut dst, &slow), Copied::All);
    // The same with the pages gone from the page cache: slow by the 16th row, inline and
    // on the pool alike.
    if !drop_cached(&t) {
        eprintln!("the page cache kept the file (tmpfs?): the stop is not exercised here");
        return;
    }
    assert_eq!(src.copy_if(&ids, &mut dst, &slow), Copied::Slow);
    let more: Vec<i64> = (0..4096).map(|i| (i * 1031) % 4096).collect();
    let mut big = vec![0u8; more.len() * src.row_bytes];
    assert!(drop_cached(&t));
    assert_eq!(
        src.copy_if_maybe_parallel(&more, &mut big, 0, None, &slow),
        Copied::Slow
    );
}

#[test]
fn a_gather_whose_known_pages_were_dropped_reads_every_row_and_gets_them_right() {
    let d = TempDir::new();
    let p = big_table(&d, 16384);
    let bytes = std::fs::read(&p).unwrap();
    let t = open(&p, &name("w")).unwrap();
    let ids: Vec<i64> = (0..1024).map(|i| (i * 7919) % 16384).collect();
    t.gather(RowIds::I64(&ids)).unwrap(); // every row's pages now known
    let before = t.page_stats();
    assert_eq!(before.row_misses + before.row_hits, ids.len() as u64);
    // The path a slow copy takes: every row read, known or not, none copied from the map.
    let src = t.mapped_rows();
    let mut dst = vec![0u8; ids.len() * src.row_bytes];
    t.gather_cold(&src, &ids, &mut dst, true, None).unwrap();
    let after = t.page_stats();
    assert_eq!(after.row_misses - before.row_misses, ids.len() as u64);
    assert_eq!(after.row_hits, before.row_hits);
    let start = t.inner.layout.segments[0].start;
    for (k, &id) in ids.iter().enumerate() {
        let off = start + id as usize * 256;
        assert_eq!(
            &dst[k * 256..(k + 1) * 256],
            &bytes[off..off + 256],
            "row {id}"
        );
    }
}

#[test]
fn after_a_slow_copy_gathers_read_every_row_for_a_while() {
    let d = TempDir::new();
    let p = big_table(&d, 4096);
    let t = open(&p, &name("w")).unwrap();
    let ids: Vec<i64> = (0..256).map(|i| (i * 13) % 4096).collect();
    let want = t.gather(RowIds::I64(&ids)).unwrap();
    let warm = t.page_stats();
    assert_eq!(t.gather(RowIds::I64(&ids)).unwrap(), want);
    assert_eq!(
        t.page_stats().row_hits - warm.row_hits,
        256,
        "known rows are copied"
    );
    t.note_slow_copy();
    let s0 = t.page_stats();
    assert_eq!(s0.slow_copies, 1);
    // A window of the table shares its pages, so it distrusts them too.
    let w = t.window(Some((0, 64)), None).unwrap();
    assert_eq!(t.gather(RowIds::I64(&ids)).unwrap(), want);
    w.gather(RowIds::I64(&ids)).unwrap();
    let s1 = t.page_stats();
    assert_eq!(
        s1.row_misses - s0.row_misses,
        512,
        "every row read while distrusted"
    );
    assert_eq!(s1.row_hits, s0.row_hits);
    // Once the window has passed, known rows are copied again.
    t.inner.distrust_until.store(1, Ordering::Relaxed);
    assert_eq!(t.gather(RowIds::I64(&ids)).unwrap(), want);
    assert_eq!(t.page_stats().row_hits - s1.row_hits, 256);
}

#[test]
fn in_page_cache_answers_for_spans_of_any_length() {
    let d = TempDir::new();
    let p = big_table(&d, 16384); // 4 MiB
    let t = open(&p, &name("w")).unwrap();
    assert_eq!(t.prewarm(u64::MAX).unwrap(), t.data_bytes());
    let src = t.mapped_rows();
    let map = &src.files[0].map;
    let start = src.segments[0].start;
    for (off, len) in [
        (0, 1),
        (3, 256),
        (4000, 200),
        (1, 100 << 10),
        (777, 1 << 20),
    ] {
        assert!(
            pagecache::in_page_cache(&map[start + off..start + off + len]),
            "{off}+{len}"
        );
    }
    assert!(pagecache::in_page_cache(&map[start..start]));
    t.drop_pages().unwrap();
    if t.resident_bytes().unwrap() > 0 {
        eprintln!("the page cache kept the file (tmpfs?): only the cached answers checked");
        return;
    }
    for (off, len) in [(0, 1), (4000, 200), (1, 100 << 10)] {
        assert!(
            !pagecache::in_page_cache(&map[start + off..start + off + len]),
            "{off}+{len}"
        );
    }
}

#[test]
fn an_ordered_gather_waits_only_before_reading_cold_rows() {
    let d = TempDir::new();
    let p = big_table(&d, 16384);
    let t = open(&p, &name("w")).unwrap();
    let ids: Vec<i64> = (0..64).map(|i| i * 251 % 16384).collect();
    let want = t.gather(RowIds::I64(&ids)).unwrap();
    let mut calls = Vec::new();
    let mut count = |n| {
        calls.push(n);
        Ok(())
    };
    let mut got = vec![0u8; want.len()];
    // Every row read before: known resident, so nothing to wait for.
    t.gather_into_ordered(RowIds::I64(&ids), &mut got, &mut count)
        .unwrap();
    assert_eq!(got, want);
    // Evicted, half read again: one call (with the cold rows' count) before they are read.
    t.drop_pages().unwrap();
    t.gather(RowIds::I64(&ids[..32])).unwrap();
    let mut got = vec![0u8; want.len()];
    t.gather_into_ordered(RowIds::I64(&ids), &mut got, &mut count)
        .unwrap();
    assert_eq!(got, want);
    // A bad id is refused before anything, the call included.
    let e = t
        .gather_into_ordered(RowIds::I64(&[1 << 40]), &mut got[..256], &mut count)
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::RowId);
    assert_eq!(calls, [32]);
    // The call's error ends the gather before any read: returned, the rows zeroed.
    t.drop_pages().unwrap();
    let before = t.page_stats();
    let e = t
        .gather_into_ordered(RowIds::I64(&ids), &mut got, &mut |_| Err(Error::Closed))
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Closed);
    assert!(got.iter().all(|&b| b == 0));
    assert_eq!(t.page_stats().pages_read, before.pages_read);
}
