//! Fuzz `MmapTable::open` on hostile checkpoints: single files and indexed directories
//! with up to three shard files, random and truncated headers and index files. Any input
//! must give a typed error or a table whose gathers stay in bounds; never a panic.
//!
//! Input layout: byte 0 picks the mode, the selector and the options (bit 7: `access`
//! normal; the input length picks `cold_reads`); the rest is split on `#SEP` into
//! the single file (or the index), then `f1.safetensors`, `f2.safetensors`, `f3.safetensors`.

#![no_main]

use std::path::PathBuf;
use std::sync::OnceLock;

use libfuzzer_sys::fuzz_target;
use ple_memops::table::{Access, ColdReads, MmapTable, RowIds, Selector, TableOptions};

fn workdir() -> &'static PathBuf {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let base = std::env::var_os("FUZZ_TMP").map_or_else(std::env::temp_dir, PathBuf::from);
        let d = base.join(format!("ple-fuzz-{}", std::process::id()));
        std::fs::create_dir_all(&d).expect("fuzz work dir");
        d
    })
}

fn split(data: &[u8]) -> Vec<&[u8]> {
    let mut parts = Vec::new();
    let mut rest = data;
    while parts.len() < 3 {
        match rest.windows(4).position(|w| w == b"#SEP") {
            Some(i) => {
                parts.push(&rest[..i]);
                rest = &rest[i + 4..];
            }
            None => break,
        }
    }
    parts.push(rest);
    parts
}

fuzz_target!(|data: &[u8]| {
    let Some((&ctl, rest)) = data.split_first() else {
        return;
    };
    let dir = workdir();
    for f in ["model.safetensors", "model.safetensors.index.json", "f1.safetensors", "f2.safetensors", "f3.safetensors"] {
        let _ = std::fs::remove_file(dir.join(f));
    }
    let parts = split(rest);
    let indexed = ctl & 1 == 1;
    if indexed {
        let _ = std::fs::write(dir.join("model.safetensors.index.json"), parts[0]);
        for (i, p) in parts.iter().enumerate().skip(1) {
            let _ = std::fs::write(dir.join(format!("f{i}.safetensors")), p);
        }
    } else {
        let _ = std::fs::write(dir.join("model.safetensors"), parts[0]);
    }
    let sel = match (ctl >> 1) & 3 {
        0 => Selector::Name("w".into()),
        1 => Selector::Name("embed_tokens_per_layer.weight".into()),
        2 => Selector::Pattern("s{}".into()),
        _ => Selector::Pattern("model.layers.2.ple.shard_{}.weight".into()),
    };
    let opts = TableOptions {
        parallel_min_bytes: if ctl & 8 != 0 { 0 } else { usize::MAX },
        readahead: ctl & 16 != 0,
        rss_budget_bytes: (ctl & 32 != 0).then_some(8192),
        prewarm_bytes: (ctl & 64 != 0).then_some(1 << 16),
        access: if ctl & 128 != 0 { Access::Normal } else { Access::Random },
        cold_reads: [ColdReads::Auto, ColdReads::WillNeed, ColdReads::Pool, ColdReads::Fault]
            [rest.len() % 4],
    };
    let Ok(t) = MmapTable::open(dir, &sel, opts) else {
        return;
    };
    let n = t.rows();
    assert!(n > 0 && t.row_bytes() > 0);
    let rb = t.row_bytes();
    let good = [0i64, (n - 1) as i64, (n / 2) as i64, 0];
    let mut dst = vec![0u8; good.len() * rb];
    t.gather_into(RowIds::I64(&good), &mut dst).expect("in-range ids gather");
    assert_eq!(&dst[..rb], &dst[3 * rb..], "row 0 twice differs");
    let bad = [0i64, n as i64, -1];
    let mut dst2 = vec![0x5a; bad.len() * rb];
    assert!(t.gather_into(RowIds::I64(&bad), &mut dst2).is_err());
    assert!(dst2.iter().all(|&b| b == 0x5a), "bad ids wrote");
    let _ = t.resident_bytes();
    let _ = t.prewarm(4096);
    let _ = t.drop_pages();
});
