//! On-CPU time of this thread and of this process from Linux `/proc/.../schedstat`
//! (nanoseconds). Benchmarks print it beside wall time: on a shared machine other tenants'
//! steal inflates wall time but not the time our threads actually ran.

/// Nanoseconds the calling thread has run on a CPU; None where `/proc` is unavailable.
pub fn thread_cpu_ns() -> Option<u64> {
    schedstat_ns("/proc/thread-self/schedstat")
}

/// Nanoseconds all live threads of this process have run on a CPU (threads that already
/// exited are not counted: the thread pools of r3 live for the whole process).
pub fn process_cpu_ns() -> Option<u64> {
    let tasks = std::fs::read_dir("/proc/self/task").ok()?;
    let mut total = 0u64;
    for task in tasks {
        let path = task.ok()?.path().join("schedstat");
        // A thread can exit between listing and reading: it no longer counts.
        total += schedstat_ns(&path).unwrap_or(0);
    }
    Some(total)
}

/// First field of a schedstat file: time spent on the CPU, ns.
fn schedstat_ns(path: impl AsRef<std::path::Path>) -> Option<u64> {
    let s = std::fs::read_to_string(path).ok()?;
    s.split_whitespace().next()?.parse().ok()
}

/// CPU seconds between two `process_cpu_ns` readings, if both exist.
pub fn cpu_seconds(before: Option<u64>, after: Option<u64>) -> Option<f64> {
    match (before, after) {
        (Some(a), Some(b)) if b >= a => Some((b - a) as f64 * 1e-9),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn busy_work_shows_up_as_cpu_time() {
        let (t0, p0) = (thread_cpu_ns(), process_cpu_ns());
        if t0.is_none() || p0.is_none() {
            return; // not Linux: nothing to check
        }
        let start = std::time::Instant::now();
        let mut x = 0u64;
        while start.elapsed().as_millis() < 50 {
            x = std::hint::black_box(x.wrapping_mul(6364136223846793005).wrapping_add(1));
        }
        let thread = cpu_seconds(t0, thread_cpu_ns()).unwrap();
        let process = cpu_seconds(p0, process_cpu_ns()).unwrap();
        assert!(thread > 0.01, "thread cpu {thread}");
        assert!(
            process >= thread * 0.9,
            "process {process} < thread {thread}"
        );
        assert_eq!(cpu_seconds(Some(5), Some(3)), None);
    }
}
