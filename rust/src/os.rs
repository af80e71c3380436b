//! Operating-system tuning for the crate's own threads (the one `unsafe` call outside
//! CUDA and the page cache).

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
