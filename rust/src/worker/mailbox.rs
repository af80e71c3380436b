//! Putting a step's ids into the mailbox: from the GPU ([`GatherWorker::publish`], eagerly
//! or under capture) or from the host ([`GatherWorker::publish_from_host`]).

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use super::gather_worker::GatherWorker;
use super::options::PublishPath;
use super::pace::{pause, NAP};
use crate::cuda::driver::{self, DevicePtr, Stream};
use crate::error::{Error, Op, Result};

impl GatherWorker {
    /// Enqueue the publish of `ids` (device address of `max_ids` ids; `count_dev` 0 or the
    /// device address of an int32 count) on `stream`, eagerly or under capture.
    ///
    /// # Safety
    /// `ids` and `count_dev` are device addresses on the rows' device (`stream`'s) that stay
    /// valid for every execution (graph replays included).
    pub unsafe fn publish(
        &self,
        stream: Stream,
        ids: DevicePtr,
        n_ids: usize,
        count_dev: DevicePtr,
    ) -> Result<()> {
        let sh = &self.shared;
        let (Some(ctx), Some(kernels)) = (&sh.ctx, &sh.kernels) else {
            return Err(Error::state(
                Op::Enqueue,
                "host mode: publish ids with publish_from_host()",
            ));
        };
        sh.rows
            .poison_cause()
            .map_or(Ok(()), |cause| Err(Error::Poisoned { cause }))?;
        // What the enqueue needs of the mailbox, read and the lock released before `ctl`
        // is taken (the lock order is ctl, then mailbox: see `Shared`). Its addresses
        // are fixed for its life, so nothing here needs the lock held.
        let (max_ids, (m_ids, m_count, m_ready), elem, ids_host, count_host) = {
            let mailbox = sh.mailbox();
            (
                mailbox.max_ids(),
                mailbox.device_ptrs().expect("pinned mailbox"),
                mailbox.id_bytes(),
                mailbox.ids_host_ptr(),
                mailbox.count_host_ptr(),
            )
        };
        if n_ids == 0 || n_ids > max_ids {
            return Err(Error::rows(format!(
                "publish of {n_ids} ids: the mailbox holds 1..={max_ids}"
            )));
        }
        let dev = ctx.ordinal();
        let _g = ctx.bind()?;
        let stream = stream.raw();
        // SAFETY: `stream` is live (`Stream::from_raw`'s contract).
        let capture = unsafe { driver::capture_id(stream, dev)? };
        let mut ctl = sh.ctl();
        match capture {
            Some(id) if ctl.captures.contains(&id) => {
                return Err(Error::state(
                    Op::Enqueue,
                    "already published in this capture: one publish per step",
                ))
            }
            None if ctl.next_to_fill().is_none() => {
                return Err(Error::state(
                    Op::Enqueue,
                    "eager publish with no step armed: call begin() first (an unarmed publish would be an unaccounted step)",
                ))
            }
            _ => {}
        }
        // SAFETY: the mailbox is retained forever once anything was published (see drop),
        // the caller vouches for `ids` and `count_dev`, `Stream` for `stream`.
        unsafe {
            match sh.opts.path {
                PublishPath::Kernel => kernels
                    .publish_ids(stream, ids, n_ids, count_dev, elem, m_ids, m_count, m_ready)?,
                PublishPath::Memop => {
                    driver::copy_d2h_async(ids_host, ids, n_ids * elem, stream, dev)?;
                    if count_dev != 0 {
                        driver::copy_d2h_async(count_host, count_dev, 4, stream, dev)?;
                    } else {
                        driver::write_u32(stream, m_count, n_ids as u32, dev)?;
                    }
                    driver::write_u32(stream, m_ready, 1, dev)?;
                }
            }
        }
        ctl.published = true;
        if let Some(id) = capture {
            ctl.captures.push(id);
            ctl.stats.publishes_captured += 1;
        } else {
            ctl.stats.publishes_eager += 1;
        }
        Ok(())
    }

    /// Give the oldest armed step that has no ids yet the ids the host knows; the worker
    /// thread gathers and fills them. This is how host-known ids should reach a step's
    /// rows: the call only copies the ids into the mailbox, so it may come before the
    /// launch (the gather then overlaps it) or from any thread after it, and the thread
    /// that launches the graph never has to fill. (Filling from the launching thread after
    /// the launch can stall until the watchdog: with a copy-engine consumer and thousands
    /// of nodes behind its wait, the launch itself may not return before the wait was
    /// passed: BENCHMARKS.md, "A launch that waits for the GPU".)
    ///
    /// One call per armed step, in step order. Refused (nothing written) when the worker
    /// is closed or poisoned, when no armed step lacks ids, or when the previous ids are
    /// still in the mailbox after `timeout` (the worker takes them as soon as it is done
    /// with the step before). A graph of a step given host ids must not publish its own.
    pub fn publish_from_host(&self, ids: &[i64], timeout: Duration) -> Result<()> {
        let sh = &self.shared;
        let max_ids = sh.mailbox().max_ids();
        if ids.len() > max_ids {
            return Err(Error::rows(format!(
                "{} ids: the mailbox holds at most {max_ids}",
                ids.len()
            )));
        }
        let id_bytes = sh.mailbox().id_bytes();
        if id_bytes == 4 {
            // The mailbox holds int32 ids: a wider one would be truncated into another row.
            if let Some(position) = ids.iter().position(|&v| i32::try_from(v).is_err()) {
                return Err(Error::RowId {
                    id: ids[position],
                    position,
                    rows: sh.source.rows(),
                    table: sh.source.name(),
                });
            }
        }
        let _order = sh.host_publish.lock().unwrap_or_else(|e| e.into_inner());
        let step = {
            let mut ctl = sh.ctl();
            if sh.stop.load(Ordering::Acquire) {
                return Err(Error::Closed);
            }
            if let Some(e) = ctl.take_failure() {
                return Err(e);
            }
            sh.rows
                .poison_cause()
                .map_or(Ok(()), |cause| Err(Error::Poisoned { cause }))?;
            ctl.next_for_host_ids().ok_or_else(|| Error::NoArmedStep {
                op: Op::Fill,
                detail: "no armed step is waiting for ids: call begin() first (one publish per begun step)".into(),
            })?
        };
        let deadline = Instant::now() + timeout;
        let t0 = Instant::now();
        loop {
            {
                let mailbox = sh.mailbox();
                if !mailbox.is_ready() {
                    mailbox.publish_from_host(ids);
                    break;
                }
            }
            if sh.stop.load(Ordering::Acquire) || sh.rows.is_released() {
                return Err(sh
                    .rows
                    .poison_cause()
                    .map_or(Error::Closed, |cause| Error::Poisoned { cause }));
            }
            if Instant::now() >= deadline {
                return Err(Error::state(
                    Op::Fill,
                    format!("the worker has not taken the previous step's ids within {timeout:?}; these ids were not published"),
                ));
            }
            pause(t0.elapsed(), sh.opts.spin, NAP);
        }
        let mut ctl = sh.ctl();
        ctl.host_published = ctl.host_published.max(step);
        ctl.published = true;
        ctl.stats.publishes_host += 1;
        Ok(())
    }

    /// Store ids and READY in the mailbox with no checks at all, as a graph replay would
    /// (tests of the worker's own guards, e.g. a replay nobody armed it for).
    #[doc(hidden)]
    pub fn simulate_replay_publish(&self, ids: &[i64]) {
        self.shared.mailbox().publish_from_host(ids);
        self.shared.ctl().published = true;
    }
}
