//! Time as every part records it: durations and wall-clock instants in milliseconds, the
//! unit of every deadline, timeline and report.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// `d` in whole milliseconds (saturating: no deadline here is near 2^64 ms).
pub fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

/// Wall-clock milliseconds since the UNIX epoch: the time base shared by the migrator's
/// timeline, the guests' traffic reports and the test bed (0 on a clock before 1970).
pub fn unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, millis)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn millis_saturate_and_the_clock_is_past_2020() {
        assert_eq!(millis(Duration::from_micros(1999)), 1);
        assert_eq!(millis(Duration::MAX), u64::MAX);
        assert!(unix_ms() > 1_577_836_800_000);
    }
}
