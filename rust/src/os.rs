//! Operating-system queries and tuning shared across the crate: the page size (the table's
//! mapping, page-cache calls, residency bookkeeping and SIGBUS handler all count in it)
//! and a fine timer slack for the crate's own threads. Each is one libc call (`sysconf`,
//! `prctl`), this module's only `unsafe`.

use std::sync::OnceLock;

/// The system page size (4 KiB on x86-64 Linux), read once.
pub fn page_size() -> usize {
    static PAGE: OnceLock<usize> = OnceLock::new();
    *PAGE.get_or_init(|| {
        // SAFETY: sysconf has no preconditions.
        let p = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
        usize::try_from(p)
            .ok()
            .filter(|&p| p.is_power_of_two())
            .unwrap_or(4096)
    })
}

/// Ask for a 1 us timer slack on the calling thread (Linux; elsewhere a no-op). The
/// default 50 us slack stretches a 20 us sleep to 50-70 us, which a worker polling for a
/// GPU's READY would pay as lateness.
pub(crate) fn fine_timer_slack() {
    #[cfg(target_os = "linux")]
    // SAFETY: PR_SET_TIMERSLACK takes an integer argument, touches no memory of ours and
    // affects only the calling thread; failure leaves the default slack.
    unsafe {
        libc::prctl(libc::PR_SET_TIMERSLACK, 1_000 as libc::c_ulong, 0, 0, 0);
    }
}
