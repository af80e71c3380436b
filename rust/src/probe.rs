//! The capability probe: can this device run the deferred protocol? Per device, cached.
//!
//! Three layers of evidence, each recorded as a [`Check`]: the driver loads and is new
//! enough; the device attributes say mapped host memory, unified addressing and 64-bit
//! stream memory operations are there; and a live run on a private stream: a WAIT that
//! really blocks until the host stores FILLED, the copy and the reset, then the same
//! sequence captured into a graph and replayed with a host fill between replays, and the
//! poison gate letting a replay through with no fill at all.

use std::collections::HashMap;
use std::sync::{Mutex, OnceLock};
use std::time::Duration;

use crate::cuda::driver::{self, Attr, DeviceBuffer, Kernels, OwnedStream, PrimaryContext};
use crate::cuda::pinned::{HostFlag, PinnedBuf};
use crate::error::{Error, Result};
use crate::wait::wait_until;

/// One piece of evidence.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Check {
    pub name: &'static str,
    pub passed: bool,
    pub detail: String,
}

/// The verdict for one device.
#[derive(Debug, Clone)]
pub struct Capability {
    pub device: i32,
    pub supported: bool,
    /// Why not (or "ok").
    pub reason: String,
    /// `cuDriverGetVersion`, when the driver loaded.
    pub driver_version: Option<i32>,
    pub checks: Vec<Check>,
}

const LIVE_BOUND: Duration = Duration::from_secs(2);
const PROBE_BYTES: usize = 4096;

static CACHE: OnceLock<Mutex<HashMap<i32, Capability>>> = OnceLock::new();

/// Probe `device` (cached after the first call). Errors are faults (a bad ordinal, a
/// failing driver call); "cannot run here" is `Ok` with `supported == false`.
pub fn probe(device: i32) -> Result<Capability> {
    let cache = CACHE.get_or_init(|| Mutex::new(HashMap::new()));
    let mut map = cache.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(c) = map.get(&device) {
        return Ok(c.clone());
    }
    let cap = run(device)?;
    map.insert(device, cap.clone());
    Ok(cap)
}

fn unsupported(
    device: i32,
    version: Option<i32>,
    checks: Vec<Check>,
    reason: String,
) -> Capability {
    Capability {
        device,
        supported: false,
        reason,
        driver_version: version,
        checks,
    }
}

fn run(device: i32) -> Result<Capability> {
    let mut checks = Vec::new();
    let info = match driver::driver() {
        Ok(i) => i,
        Err(Error::Unsupported { reason }) => {
            checks.push(Check {
                name: "driver",
                passed: false,
                detail: reason.clone(),
            });
            return Ok(unsupported(device, None, checks, reason));
        }
        Err(e) => return Err(e),
    };
    let version = Some(info.version);
    checks.push(Check {
        name: "driver",
        passed: true,
        detail: format!(
            "{} (CUDA {})",
            info.library,
            driver::fmt_version(info.version)
        ),
    });
    let attrs = [
        (Attr::CanMapHostMemory, "CAN_MAP_HOST_MEMORY", true),
        (Attr::UnifiedAddressing, "UNIFIED_ADDRESSING", true),
        (Attr::StreamMemOps64, "CAN_USE_64_BIT_STREAM_MEM_OPS", true),
        (Attr::WaitValueNor, "CAN_USE_STREAM_WAIT_VALUE_NOR", false),
        (
            Attr::HostPointerForRegisteredMem,
            "CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM",
            false,
        ),
    ];
    let mut missing = Vec::new();
    let mut values = Vec::new();
    for (attr, name, required) in attrs {
        let v = driver::attribute(device, attr)?;
        values.push(format!("{name}={v}"));
        if required && v == 0 {
            missing.push(name);
        }
    }
    checks.push(Check {
        name: "attributes",
        passed: missing.is_empty(),
        detail: values.join(", "),
    });
    if !missing.is_empty() {
        let reason = format!("device attribute(s) {} are 0", missing.join(", "));
        return Ok(unsupported(device, version, checks, reason));
    }
    let ctx = PrimaryContext::retain(device)?;
    let _g = ctx.bind()?;
    type Live = fn(i32) -> std::result::Result<String, Failure>;
    let live: [(&'static str, Live); 3] = [
        ("live_wait", live_wait),
        ("capture_replay", |d| capture_replay(d, false)),
        ("kernel_replay", |d| capture_replay(d, true)),
    ];
    for (name, check) in live {
        match check(device) {
            Ok(detail) => checks.push(Check {
                name,
                passed: true,
                detail,
            }),
            Err(Failure::Unsupported(why)) => {
                checks.push(Check {
                    name,
                    passed: false,
                    detail: why.clone(),
                });
                return Ok(unsupported(
                    device,
                    version,
                    checks,
                    format!("{name}: {why}"),
                ));
            }
            Err(Failure::Fault(e)) => return Err(e),
        }
    }
    Ok(Capability {
        device,
        supported: true,
        reason: "ok".into(),
        driver_version: version,
        checks,
    })
}

enum Failure {
    Unsupported(String),
    Fault(Error),
}

impl From<Error> for Failure {
    fn from(e: Error) -> Self {
        if driver::is_unsupported_code(&e) {
            Failure::Unsupported(e.to_string())
        } else {
            Failure::Fault(e)
        }
    }
}

/// The probe's private resources. Failing to allocate them is a fault (for instance,
/// another thread capturing in global mode), never an "unsupported" verdict: that would be
/// cached for the life of the process.
struct Rig {
    stream: OwnedStream,
    flag: HostFlag,
    slot: PinnedBuf,
    dst: DeviceBuffer,
    device: i32,
}

impl Rig {
    fn new(device: i32) -> Result<Self> {
        Ok(Self {
            stream: OwnedStream::new(device)?,
            flag: HostFlag::new(device)?,
            slot: PinnedBuf::new(PROBE_BYTES, device)?,
            dst: DeviceBuffer::new(PROBE_BYTES, device)?,
            device,
        })
    }

    fn enqueue(&self, kernel: bool) -> Result<()> {
        let (s, d) = (self.stream.raw, self.device);
        if kernel {
            let k = Kernels::get(d)?;
            let (src, gate) = (self.slot.device_ptr(), self.flag.gate_device_ptr());
            // SAFETY: as below; the slot's device address and the buffer hold PROBE_BYTES.
            return unsafe {
                k.wait_copy_reset(
                    s,
                    src,
                    self.dst.ptr,
                    PROBE_BYTES,
                    gate,
                    HostFlag::WAIT_MASK,
                    None,
                )
            };
        }
        // SAFETY: the rig's stream, flag, slot and buffer outlive every use: the rig
        // synchronises its stream (and drops its graph) before they are freed.
        unsafe {
            driver::wait_any_bit64(s, self.flag.gate_device_ptr(), HostFlag::WAIT_MASK, d)?;
            driver::copy_h2d_async(self.dst.ptr, self.slot.host_ptr(), PROBE_BYTES, s, d)?;
            driver::write_u32(s, self.flag.gate_device_ptr(), HostFlag::EMPTY, d)?;
        }
        Ok(())
    }

    fn fill(&mut self, seed: u8) {
        for (i, b) in self.slot.as_mut_slice().iter_mut().enumerate() {
            *b = (i as u8).wrapping_mul(31).wrapping_add(seed);
        }
        self.flag.store_filled();
    }

    /// Wait for the stream to drain (bounded); on timeout open the gate so it can.
    fn drain(&self, what: &str) -> std::result::Result<(), Failure> {
        let mut err = None;
        let done = wait_until(LIVE_BOUND, || match self.stream.query() {
            Ok(d) => d,
            Err(e) => {
                err = Some(e);
                true
            }
        });
        if let Some(e) = err {
            self.flag.store_poison();
            return Err(e.into());
        }
        if !done {
            self.flag.store_poison();
            let _ = self.stream.synchronize();
            return Err(Failure::Unsupported(format!(
                "{what}: the GPU did not pass the WAIT within {LIVE_BOUND:?} of the fill"
            )));
        }
        Ok(())
    }

    fn verify(&self, seed: u8, what: &str) -> std::result::Result<(), Failure> {
        let mut out = vec![0u8; PROBE_BYTES];
        self.stream.read_device(self.dst.ptr, &mut out)?;
        if out != self.slot.as_slice() {
            return Err(Failure::Unsupported(format!(
                "{what}: copied bytes differ (seed {seed})"
            )));
        }
        if self.flag.filled() != HostFlag::EMPTY {
            return Err(Failure::Unsupported(format!(
                "{what}: the GPU did not reset the flag"
            )));
        }
        Ok(())
    }
}

impl Drop for Rig {
    fn drop(&mut self) {
        self.flag.store_poison();
        let _ = self.stream.synchronize();
    }
}

fn live_wait(device: i32) -> std::result::Result<String, Failure> {
    let mut rig = Rig::new(device).map_err(Failure::Fault)?;
    rig.enqueue(false)?;
    std::thread::sleep(Duration::from_millis(2));
    if rig.stream.query()? {
        return Err(Failure::Unsupported(
            "the WAIT did not block before the host stored FILLED".into(),
        ));
    }
    let t = std::time::Instant::now();
    rig.fill(7);
    rig.drain("eager")?;
    let us = t.elapsed().as_secs_f64() * 1e6;
    rig.verify(7, "eager")?;
    Ok(format!(
        "WAIT blocked, released {us:.1} us after the fill; bytes and reset ok"
    ))
}

fn capture_replay(device: i32, kernel: bool) -> std::result::Result<String, Failure> {
    const REPLAYS: u8 = 3;
    let mut rig = Rig::new(device).map_err(Failure::Fault)?;
    rig.stream.begin_capture()?;
    let captured = rig.enqueue(kernel);
    let graph = rig.stream.end_capture();
    captured?;
    let graph = graph?;
    for seed in 0..REPLAYS {
        graph.launch(&rig.stream)?;
        if seed == 0 {
            // The replay must really wait for the fill.
            std::thread::sleep(Duration::from_millis(2));
            if rig.stream.query()? {
                rig.flag.store_poison();
                return Err(Failure::Unsupported(
                    "a replay passed the wait without a fill".into(),
                ));
            }
        }
        rig.fill(seed.wrapping_mul(17));
        rig.drain("replay")?;
        rig.verify(seed.wrapping_mul(17), "replay")?;
    }
    // Poisoned gate: two replays pass without any fill (the reset cannot close it).
    rig.flag.store_poison();
    graph.launch(&rig.stream)?;
    graph.launch(&rig.stream)?;
    rig.drain("poisoned replay")?;
    drop(graph);
    let how = if kernel {
        "wait-copy-reset kernel"
    } else {
        "WAIT/H2D/WRITE"
    };
    Ok(format!(
        "{how}: {REPLAYS} replays with host fills ok; poisoned gate passes replays"
    ))
}
