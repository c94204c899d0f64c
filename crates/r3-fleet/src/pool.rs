//! The workers' bookkeeping: which are up, at which weight version, and how many requests
//! each has outstanding; picking the least-loaded worker for the next request.

use std::fmt::Write as _;
use std::ops::RangeInclusive;

/// One worker as the client sees it.
#[derive(Debug, Clone, PartialEq)]
pub struct WorkerSlot {
    /// Base URL.
    pub url: String,
    /// Requests sent and not yet answered.
    pub outstanding: usize,
    /// Whether requests may go to it (reachable and at the current weights).
    pub up: bool,
    /// Why it is down (for the error when none is left).
    pub down_reason: Option<String>,
    /// Weight version it last confirmed.
    pub version: Option<u64>,
}

/// All workers.
#[derive(Debug, Clone, PartialEq)]
pub struct WorkerPool {
    slots: Vec<WorkerSlot>,
}

impl WorkerPool {
    /// Workers at `urls` (trailing `/` dropped), all down until probed.
    pub fn new(urls: &[String]) -> Self {
        let slots = urls
            .iter()
            .map(|u| WorkerSlot {
                url: u.trim_end_matches('/').to_string(),
                outstanding: 0,
                up: false,
                down_reason: Some("not probed yet".into()),
                version: None,
            })
            .collect();
        WorkerPool { slots }
    }

    /// The workers.
    pub fn slots(&self) -> &[WorkerSlot] {
        &self.slots
    }

    /// Workers up.
    pub fn up_count(&self) -> usize {
        self.slots.iter().filter(|s| s.up).count()
    }

    /// The least-loaded worker that is up, preferring ones not in `avoid` (those that
    /// already failed this request); ties go to the lowest index. Its count is raised.
    pub fn acquire(&mut self, avoid: &[usize]) -> Option<usize> {
        let best = |skip_avoided: bool| {
            self.slots
                .iter()
                .enumerate()
                .filter(|(i, s)| s.up && !(skip_avoided && avoid.contains(i)))
                .min_by_key(|(i, s)| (s.outstanding, *i))
                .map(|(i, _)| i)
        };
        let pick = best(true).or_else(|| best(false))?;
        self.slots[pick].outstanding += 1;
        Some(pick)
    }

    /// Whether a worker other than `i`, up and not in `avoid`, could take a retry.
    pub fn another_up(&self, i: usize, avoid: &[usize]) -> bool {
        self.slots
            .iter()
            .enumerate()
            .any(|(j, s)| j != i && s.up && !avoid.contains(&j))
    }

    /// A request to worker `i` has finished (either way).
    pub fn release(&mut self, i: usize) {
        if let Some(s) = self.slots.get_mut(i) {
            s.outstanding = s.outstanding.saturating_sub(1);
        }
    }

    /// Takes worker `i` out until a probe and a sync bring it back.
    pub fn mark_down(&mut self, i: usize, reason: String) {
        if let Some(s) = self.slots.get_mut(i) {
            if s.up {
                tracing::warn!(worker = %s.url, %reason, "rollout worker out");
            }
            s.up = false;
            s.down_reason = Some(reason);
        }
    }

    /// Puts worker `i` back when it is still down for `reason` (nothing else took it out
    /// since) and last confirmed a version in `versions` (during a sync: the last finished
    /// sync's through the announced one): it was taken out for a request's own fault.
    /// Returns whether it is up again.
    pub fn reinstate(&mut self, i: usize, reason: &str, versions: RangeInclusive<u64>) -> bool {
        let Some(s) = self.slots.get_mut(i) else {
            return false;
        };
        let current = s.version.is_some_and(|v| versions.contains(&v));
        if s.up || s.down_reason.as_deref() != Some(reason) || !current {
            return s.up;
        }
        tracing::info!(worker = %s.url, "rollout worker back: the fault was the request's");
        s.up = true;
        s.down_reason = None;
        true
    }

    /// Worker `i` confirmed weight version `version` and takes requests.
    pub fn mark_up(&mut self, i: usize, version: u64) {
        if let Some(s) = self.slots.get_mut(i) {
            if !s.up {
                tracing::info!(worker = %s.url, version, "rollout worker up");
            }
            s.up = true;
            s.down_reason = None;
            s.version = Some(version);
        }
    }

    /// Why each worker is down, for the "no worker left" error.
    pub fn down_summary(&self) -> String {
        let mut out = String::new();
        for s in self.slots.iter().filter(|s| !s.up) {
            if !out.is_empty() {
                out.push_str("; ");
            }
            let _ = write!(
                out,
                "{}: {}",
                s.url,
                s.down_reason.as_deref().unwrap_or("down")
            );
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pool(n: usize) -> WorkerPool {
        let urls: Vec<String> = (0..n).map(|i| format!("http://w{i}/")).collect();
        let mut p = WorkerPool::new(&urls);
        for i in 0..n {
            p.mark_up(i, 0);
        }
        p
    }

    #[test]
    fn requests_spread_to_the_least_loaded_worker() {
        let mut p = pool(3);
        let picks: Vec<usize> = (0..6).filter_map(|_| p.acquire(&[])).collect();
        assert_eq!(picks, vec![0, 1, 2, 0, 1, 2]);
        p.release(1);
        p.release(1);
        assert_eq!(p.acquire(&[]), Some(1), "worker 1 now has the fewest");
        assert_eq!(p.slots()[1].outstanding, 1);
    }

    #[test]
    fn a_failed_worker_is_avoided_and_a_down_worker_never_picked() {
        let mut p = pool(2);
        assert_eq!(p.acquire(&[0]), Some(1), "avoids the worker that failed");
        p.mark_down(1, "refused".into());
        assert_eq!(p.acquire(&[0]), Some(0), "falls back to an avoided one");
        p.mark_down(0, "timeout".into());
        assert_eq!(p.acquire(&[]), None);
        assert_eq!(p.up_count(), 0);
        let s = p.down_summary();
        assert!(
            s.contains("http://w0: timeout") && s.contains("http://w1: refused"),
            "{s}"
        );
    }

    #[test]
    fn a_worker_is_reinstated_only_when_nothing_else_took_it_out() {
        let mut p = pool(2);
        p.mark_down(0, "HTTP 500: boom".into());
        assert!(!p.reinstate(0, "HTTP 500: boom", 1..=1), "another version");
        assert!(!p.reinstate(0, "refused", 0..=0), "out for another reason");
        assert!(
            p.reinstate(0, "HTTP 500: boom", 0..=1),
            "mid-sync from 0 to 1"
        );
        assert_eq!(p.up_count(), 2);
        assert_eq!(p.slots()[0].down_reason, None);
    }
}
