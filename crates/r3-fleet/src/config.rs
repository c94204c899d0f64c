//! What the fleet client needs to know: worker URLs, limits, credentials, and the facts of
//! the model that every reply is checked against.

use std::time::Duration;

use r3_routing::{LayerLayout, MergePolicy, WireShape};

use crate::error::{FleetError, Result};

/// Client settings (from the trainer's `[rollout]` section).
#[derive(Debug, Clone, PartialEq)]
pub struct FleetConfig {
    /// Worker base URLs (`http://host:port`), or one router URL.
    pub urls: Vec<String>,
    /// Most `/generate` requests in flight at once over the whole fleet.
    pub max_in_flight: usize,
    /// Longest wait for one HTTP answer.
    pub request_timeout: Duration,
    /// Extra attempts of one request after a worker fault (each on another worker if any).
    pub max_retries: u32,
    /// Sent as `Authorization: Bearer <key>` when set.
    pub api_key: Option<String>,
    /// Replies from weights at most this many versions old are accepted (and counted).
    pub max_staleness: u64,
    /// What happens to a request a worker aborted (at a weight update).
    pub partial: PartialMode,
    /// How the route pieces of a resumed request are combined.
    pub merge: MergePolicy,
}

/// What the client does with a request a worker aborted (finish reason `abort`, e.g. at
/// a weight update with `abort_all_requests`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PartialMode {
    /// Continue it after the sync from the tokens it already has (partial rollout).
    #[default]
    Resume,
    /// Send it again from the prompt, dropping what was generated.
    Restart,
}

impl FleetConfig {
    /// Checks the settings; URLs must be plain `http://` (no TLS in this client).
    pub fn validate(&self) -> Result<()> {
        if self.urls.is_empty() {
            return Err(FleetError::Config(
                "rollout.urls is empty; give at least one worker URL".into(),
            ));
        }
        for u in &self.urls {
            if !u.starts_with("http://") {
                return Err(FleetError::Config(format!(
                    "rollout.urls entry {u:?} must start with http:// (put a TLS proxy in front for https)"
                )));
            }
            u.parse::<hyper::Uri>()
                .map_err(|e| FleetError::Config(format!("rollout.urls entry {u:?}: {e}")))?;
        }
        if self.max_in_flight == 0 {
            return Err(FleetError::Config(
                "rollout.max_in_flight must be >= 1".into(),
            ));
        }
        if self.request_timeout.is_zero() {
            return Err(FleetError::Config(
                "rollout.request_timeout_s must be > 0".into(),
            ));
        }
        Ok(())
    }
}

/// The served model as the trainer knows it: what a reply's ids and routes must fit.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelFacts {
    /// Token ids must be below this.
    pub vocab_size: usize,
    /// Which of the hidden layers are MoE.
    pub layout: LayerLayout,
    /// Experts per token.
    pub top_k: usize,
    /// Experts per MoE layer.
    pub num_experts: usize,
}

impl ModelFacts {
    /// The wire shape of `routed_experts` whose first row is position `start_len`.
    pub fn wire_shape(&self, start_len: usize) -> Result<WireShape> {
        WireShape::new(
            self.layout.num_hidden_layers(),
            self.top_k,
            self.num_experts,
        )
        .with_start_len(start_len)
        .with_layout(self.layout.clone())
        .map_err(|e| FleetError::Config(format!("model layout: {e}")))
    }
}
