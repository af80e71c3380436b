//! The crate's one error type.
//!
//! Every fallible call returns [`Error`]. Each variant carries enough context to act on
//! (which driver call, which device, how many bytes, which state). The Python bindings
//! convert it exactly once, by [`Error::kind`], into a small exception hierarchy.

use std::fmt;

/// Stable names of the error families; the Python layer maps each to one exception class.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ErrorKind {
    /// The deferred path cannot run here (no driver, no device, a capability missing).
    Unsupported,
    /// A CUDA driver call failed.
    Driver,
    /// The object was aborted earlier; carries the first cause.
    Poisoned,
    /// The object was closed.
    Closed,
    /// A lifecycle call out of order (fill twice, complete without fill, ...).
    State,
    /// The host may not write the slot: the GPU has not consumed the previous fill.
    SlotBusy,
    /// Rows of the wrong width, type or count.
    RowShape,
    /// A bad argument (sizes, device ordinals, staging buffers).
    InvalidArgument,
    /// A memory-mapped table could not be opened or validated.
    Table,
    /// A row id outside the table.
    RowId,
    /// An I/O error on a file.
    Io,
    /// A graph replay published ids with no step armed (replayed without `begin()`).
    UnarmedReplay,
    /// Host ids for a worker with no armed step waiting for them (a [`ErrorKind::State`]
    /// error in kind: nothing was written and no step is left waiting).
    NoArmedStep,
}

impl ErrorKind {
    /// Every kind, for tests that pin the Python mapping.
    pub const ALL: [ErrorKind; 13] = [
        ErrorKind::Unsupported,
        ErrorKind::Driver,
        ErrorKind::Poisoned,
        ErrorKind::Closed,
        ErrorKind::State,
        ErrorKind::SlotBusy,
        ErrorKind::RowShape,
        ErrorKind::InvalidArgument,
        ErrorKind::Table,
        ErrorKind::RowId,
        ErrorKind::Io,
        ErrorKind::UnarmedReplay,
        ErrorKind::NoArmedStep,
    ];

    /// Whether this kind is a lifecycle error (its Python class derives from
    /// `StateError`).
    pub fn is_state(self) -> bool {
        matches!(
            self,
            ErrorKind::State
                | ErrorKind::SlotBusy
                | ErrorKind::UnarmedReplay
                | ErrorKind::NoArmedStep
        )
    }

    /// The name of the Python exception class this kind maps to.
    pub fn python_name(self) -> &'static str {
        match self {
            ErrorKind::Unsupported => "UnsupportedError",
            ErrorKind::Driver => "CudaDriverError",
            ErrorKind::Poisoned => "PoisonedError",
            ErrorKind::Closed => "ClosedError",
            ErrorKind::State => "StateError",
            ErrorKind::SlotBusy => "SlotBusyError",
            ErrorKind::RowShape => "RowShapeError",
            ErrorKind::InvalidArgument => "InvalidArgumentError",
            ErrorKind::Table => "TableError",
            ErrorKind::RowId => "RowIdError",
            ErrorKind::Io => "TableIoError",
            ErrorKind::UnarmedReplay => "UnarmedReplayError",
            ErrorKind::NoArmedStep => "NoArmedStepError",
        }
    }
}

/// A lifecycle operation, named in state errors.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op {
    Begin,
    Fill,
    PrepareDummy,
    Enqueue,
    Complete,
}

impl fmt::Display for Op {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Op::Begin => "begin",
            Op::Fill => "fill",
            Op::PrepareDummy => "prepare_dummy",
            Op::Enqueue => "enqueue",
            Op::Complete => "complete",
        })
    }
}

/// The crate's error.
#[derive(Debug, Clone, thiserror::Error)]
pub enum Error {
    #[error("deferred rows unsupported: {reason}")]
    Unsupported { reason: String },

    #[error("{call} failed{}: {name} ({code})", device.map(|d| format!(" on cuda:{d}")).unwrap_or_default())]
    Driver {
        call: &'static str,
        device: Option<i32>,
        code: u32,
        name: String,
    },

    #[error("object is poisoned: {cause}")]
    Poisoned { cause: String },

    #[error("object is closed")]
    Closed,

    #[error("{op}() not allowed now: {detail}")]
    State { op: Op, detail: String },

    #[error("fill() refused: the GPU has not consumed the previous fill yet (flag still FILLED); call wait_consumed() first")]
    SlotBusy,

    #[error("bad rows: {detail}")]
    RowShape { detail: String },

    #[error("invalid argument: {detail}")]
    InvalidArgument { detail: String },

    #[error("{file}: {detail}")]
    Table { file: String, detail: String },

    #[error("row id {id} out of range for table {table} with {rows} rows (position {position})")]
    RowId {
        id: i64,
        position: usize,
        rows: u64,
        table: String,
    },

    #[error("{path}: {detail}")]
    Io { path: String, detail: String },

    #[error("unarmed replay: {detail}")]
    UnarmedReplay { detail: String },

    #[error("{op}() not allowed now: {detail}")]
    NoArmedStep { op: Op, detail: String },
}

impl Error {
    /// The family this error belongs to.
    pub fn kind(&self) -> ErrorKind {
        match self {
            Error::Unsupported { .. } => ErrorKind::Unsupported,
            Error::Driver { .. } => ErrorKind::Driver,
            Error::Poisoned { .. } => ErrorKind::Poisoned,
            Error::Closed => ErrorKind::Closed,
            Error::State { .. } => ErrorKind::State,
            Error::SlotBusy => ErrorKind::SlotBusy,
            Error::RowShape { .. } => ErrorKind::RowShape,
            Error::InvalidArgument { .. } => ErrorKind::InvalidArgument,
            Error::Table { .. } => ErrorKind::Table,
            Error::RowId { .. } => ErrorKind::RowId,
            Error::Io { .. } => ErrorKind::Io,
            Error::UnarmedReplay { .. } => ErrorKind::UnarmedReplay,
            Error::NoArmedStep { .. } => ErrorKind::NoArmedStep,
        }
    }

    pub(crate) fn state(op: Op, detail: impl Into<String>) -> Self {
        Error::State {
            op,
            detail: detail.into(),
        }
    }

    pub(crate) fn invalid(detail: impl Into<String>) -> Self {
        Error::InvalidArgument {
            detail: detail.into(),
        }
    }

    pub(crate) fn rows(detail: impl Into<String>) -> Self {
        Error::RowShape {
            detail: detail.into(),
        }
    }

    pub(crate) fn unsupported(reason: impl Into<String>) -> Self {
        Error::Unsupported {
            reason: reason.into(),
        }
    }
}

/// The crate's result type.
pub type Result<T, E = Error> = std::result::Result<T, E>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn python_names_are_unique() {
        let mut names: Vec<_> = ErrorKind::ALL.iter().map(|k| k.python_name()).collect();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), ErrorKind::ALL.len());
    }

    #[test]
    fn lifecycle_kinds_are_state_errors() {
        let state: Vec<_> = ErrorKind::ALL.iter().filter(|k| k.is_state()).collect();
        assert_eq!(state.len(), 4);
        assert!(ErrorKind::NoArmedStep.is_state() && !ErrorKind::Closed.is_state());
    }

    #[test]
    fn driver_error_names_call_and_device() {
        let e = Error::Driver {
            call: "cuStreamWaitValue64_v2",
            device: Some(3),
            code: 1,
            name: "CUDA_ERROR_INVALID_VALUE".into(),
        };
        assert_eq!(
            e.to_string(),
            "cuStreamWaitValue64_v2 failed on cuda:3: CUDA_ERROR_INVALID_VALUE (1)"
        );
        assert_eq!(e.kind(), ErrorKind::Driver);
    }

    #[test]
    fn state_error_names_the_operation() {
        let e = Error::state(Op::Complete, "no fill for the pending step");
        assert_eq!(
            e.to_string(),
            "complete() not allowed now: no fill for the pending step"
        );
    }
}
