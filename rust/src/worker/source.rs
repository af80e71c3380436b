//! [`RowSource`]: where a worker's rows come from.

use crate::error::Result;
use crate::table::BeforeReads;

/// Where rows come from (a memory-mapped table, or anything else that can gather).
pub trait RowSource: Send + Sync {
    /// Rows in the table.
    fn rows(&self) -> u64;
    /// Bytes per row.
    fn row_bytes(&self) -> usize;
    /// A name for error messages.
    fn name(&self) -> String;
    /// Write rows `ids` (all already checked to be in range) to `dst`, `ids.len()` rows.
    fn gather_rows(&self, ids: &[i64], dst: &mut [u8]) -> Result<()>;
    /// [`Self::gather_rows`], calling `before_reads` (which may wait) with the number of
    /// rows to read before any read from storage, and returning its error without
    /// reading: a gather that reads nothing from storage need not call it. The default (a
    /// source that never reads storage) never does.
    fn gather_rows_ordered(
        &self,
        ids: &[i64],
        dst: &mut [u8],
        before_reads: BeforeReads<'_>,
    ) -> Result<()> {
        let _ = before_reads;
        self.gather_rows(ids, dst)
    }
    /// The threads of this source's own that a gather of `rows` rows would run on, if any:
    /// the worker keeps them awake while a step is armed (see [`super::WarmThreads`]).
    fn own_pool_for(&self, _rows: usize) -> Option<&rayon::ThreadPool> {
        None
    }
}

impl RowSource for crate::table::MmapTable {
    fn rows(&self) -> u64 {
        crate::table::MmapTable::rows(self)
    }
    fn row_bytes(&self) -> usize {
        crate::table::MmapTable::row_bytes(self)
    }
    fn name(&self) -> String {
        self.label().to_string()
    }
    fn gather_rows(&self, ids: &[i64], dst: &mut [u8]) -> Result<()> {
        self.gather_into(crate::table::RowIds::I64(ids), dst)
    }
    fn gather_rows_ordered(
        &self,
        ids: &[i64],
        dst: &mut [u8],
        before_reads: BeforeReads<'_>,
    ) -> Result<()> {
        self.gather_into_ordered(crate::table::RowIds::I64(ids), dst, before_reads)
    }
    fn own_pool_for(&self, rows: usize) -> Option<&rayon::ThreadPool> {
        crate::table::MmapTable::own_pool_for(self, rows)
    }
}
