//! The process's resident memory as Linux reports it in `/proc/self/status`: the current
//! resident set (`VmRSS`) and its high-water mark (`VmHWM`), and a reset of the mark
//! (`/proc/self/clear_refs`, value `5`) so one step or phase can read its own peak.
//! Elsewhere (or where `/proc` is not readable) every reading is `None`: memory figures
//! are reported as unknown, never as zero.

use std::path::Path;

/// Where the kernel reports the process's memory.
const STATUS: &str = "/proc/self/status";
/// Writing `5` here resets the high-water mark to the current resident set (Linux ≥ 4.0).
const CLEAR_REFS: &str = "/proc/self/clear_refs";

/// One reading of the process's resident memory, in MiB.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MemoryReading {
    /// Resident set now (`VmRSS`).
    pub rss_mib: f64,
    /// Highest resident set since the process started or the mark was last reset (`VmHWM`).
    pub peak_mib: f64,
}

/// Reads the process's resident memory, or `None` where the kernel does not report it.
pub fn read_memory() -> Option<MemoryReading> {
    let text = std::fs::read_to_string(STATUS).ok()?;
    parse_status(&text)
}

/// Resets the high-water mark to the current resident set; `false` where the kernel does
/// not allow it (the mark then keeps counting from the process start).
pub fn reset_peak() -> bool {
    Path::new(CLEAR_REFS).exists() && std::fs::write(CLEAR_REFS, "5").is_ok()
}

/// The high-water mark since the last reset, in MiB, then a reset so the next phase
/// reads its own: called at the end of each phase of a step, with one [`reset_peak`] at
/// the step's start. `None` (unknown) where the kernel reports no memory or refuses the
/// reset: a mark that was not reset would be the process's, not the phase's.
pub fn lap_peak() -> Option<f64> {
    let reading = read_memory()?;
    reset_peak().then_some(reading.peak_mib)
}

/// `VmRSS` and `VmHWM` of a `/proc/<pid>/status` text, in MiB.
fn parse_status(text: &str) -> Option<MemoryReading> {
    let field = |name: &str| -> Option<f64> {
        let line = text.lines().find(|l| l.starts_with(name))?;
        let mut parts = line[name.len()..].split_whitespace();
        let value: f64 = parts.next()?.parse().ok()?;
        // The kernel writes these fields in kB (KiB).
        match parts.next()? {
            "kB" => Some(value / 1024.0),
            _ => None,
        }
    };
    Some(MemoryReading {
        rss_mib: field("VmRSS:")?,
        peak_mib: field("VmHWM:")?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_kernel_fields_in_mib() {
        let text = "Name:\tr3\nVmPeak:\t 9999 kB\nVmHWM:\t  204800 kB\nVmRSS:\t  102400 kB\n";
        let r = parse_status(text).expect("both fields present");
        assert_eq!(r.rss_mib, 100.0);
        assert_eq!(r.peak_mib, 200.0);
    }

    #[test]
    fn a_missing_or_odd_field_is_unknown_not_zero() {
        assert_eq!(parse_status("VmRSS:\t 10 kB\n"), None);
        assert_eq!(parse_status("VmRSS:\t 10 MB\nVmHWM:\t 10 kB\n"), None);
        assert_eq!(parse_status("VmRSS:\t ten kB\nVmHWM:\t 10 kB\n"), None);
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn a_resident_block_shows_and_the_mark_never_sits_below_the_resident_set() {
        // Touch 64 MiB so it is resident; other tests' threads may allocate or free
        // meanwhile, so only what holds in one snapshot is checked.
        let block = vec![1u8; 64 << 20];
        let r = read_memory().expect("linux reports memory");
        assert!(r.rss_mib >= 64.0, "{r:?}");
        assert!(r.peak_mib >= r.rss_mib, "{r:?}");
        assert_eq!(block.iter().map(|&b| b as usize).sum::<usize>(), 64 << 20);
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn a_lap_sees_a_block_freed_before_it_ended_and_the_next_lap_does_not() {
        if !reset_peak() {
            return; // a kernel that refuses the reset reports laps as unknown
        }
        let before = read_memory().expect("linux reports memory").rss_mib;
        let block = vec![1u8; 256 << 20];
        assert_eq!(block.iter().map(|&b| b as usize).sum::<usize>(), 256 << 20);
        drop(block);
        let lap = lap_peak().expect("reset works, so the lap is known");
        assert!(lap >= before + 200.0, "lap {lap} MiB from {before} MiB");
        // Other tests of this binary may allocate meanwhile, but not 256 MiB on top of it.
        let next = lap_peak().expect("second lap");
        assert!(
            next < lap,
            "the freed block is not in the next lap: {next} vs {lap}"
        );
    }
}
