//! The engine's weights moved to the host and back (what a server's
//! `/release_memory_occupation` and `/resume_memory_occupation` ask for, as SGLang with
//! `--enable-weights-cpu-backup`): the device memory they held is free meanwhile — for a
//! trainer on the same GPU — and nothing is lost. An update while they are on the host
//! writes over the host copy (`swap_in`), so the weights brought back are the newest.

use candle_core::Device;

use super::weights::build_model;
use super::{DeviceEngine, HeldWeights, Loaded};
use crate::error::RolloutError;
use r3_model::Weights;

impl DeviceEngine {
    /// Moves the model's weights (in the engine's formats) to the host and lets the model
    /// go, with the prefix cache (its keys, values and routes are on the device); steps are
    /// refused until [`DeviceEngine::onload_weights`], and queued requests (retracted ones
    /// among them: [`DeviceEngine::retract_all`]) wait. Refused while requests run: their
    /// keys and values are on the device. Nothing changes where the weights are not on the
    /// device (offloaded already, or released).
    pub fn offload_weights(&mut self) -> Result<(), RolloutError> {
        let (_, running) = self.queue_lengths();
        if running > 0 {
            return Err(RolloutError::InvalidRequest(format!(
                "the engine's weights cannot be offloaded while {running} requests run (their \
                 keys and values are on the device): retract or abort them first"
            )));
        }
        let HeldWeights::Loaded(loaded) = &self.held else {
            return Ok(());
        };
        // Copied out before anything is let go: a copy that fails leaves the engine as it
        // was.
        let host = loaded
            .weights
            .tensors()
            .iter()
            .map(|(name, t)| Ok((name.clone(), t.to_device(&Device::Cpu)?)))
            .collect::<Result<_, RolloutError>>()?;
        self.flush_prefix_cache();
        self.held = HeldWeights::Offloaded(Box::new(Weights::from_map(host)));
        Ok(())
    }

    /// Builds the model on the device again from the weights [`DeviceEngine::offload_weights`]
    /// moved to the host (an update meanwhile wrote over them), at the weight version they
    /// hold; the host copy is let go. Nothing changes where the weights are on the device
    /// already; weights released without a copy ([`DeviceEngine::release_weights`]) come
    /// back only with an update. A build that fails (device memory, above all) keeps the
    /// host copy, so it can be tried again.
    pub fn onload_weights(&mut self) -> Result<(), RolloutError> {
        let host = match &self.held {
            HeldWeights::Loaded(_) => return Ok(()),
            HeldWeights::Released(_) => {
                return Err(RolloutError::Weights(
                    "the engine's weights were released without a copy (release_weights): \
                     only a weight update brings them back"
                        .into(),
                ))
            }
            HeldWeights::Offloaded(host) => host,
        };
        let (model, weights) =
            build_model(&self.model_cfg, host.tensors(), &self.cfg, &self.device)?;
        // As at the build: the uploads are queued on this thread's stream.
        self.device.synchronize()?;
        self.held = HeldWeights::Loaded(Box::new(Loaded { model, weights }));
        Ok(())
    }

    /// Whether the weights are on the host ([`DeviceEngine::offload_weights`]).
    pub fn weights_offloaded(&self) -> bool {
        matches!(self.held, HeldWeights::Offloaded(_))
    }
}
