//! The bundled font: DejaVu Sans (license in `assets/DejaVuSans-LICENSE.txt`), registered with
//! plotters' ab_glyph text renderer under the family name plotters uses for `sans-serif`.

use std::sync::OnceLock;

use plotters::style::{register_font, FontStyle};

use super::PlotError;

/// The font file, compiled into the binary so plots need no system fonts.
static DEJAVU_SANS: &[u8] = include_bytes!("../../assets/DejaVuSans.ttf");

/// Family name under which the font is registered; every text style in `plot` uses it.
pub const FAMILY: &str = "sans-serif";

/// Registers the bundled font once per process.
///
/// plotters' ab_glyph backend keeps fonts in its own process-wide table; registering once
/// (and remembering the outcome) is the only way to use it, so this is the one place that
/// touches process-wide state.
pub fn ensure_registered() -> Result<(), PlotError> {
    static REGISTERED: OnceLock<bool> = OnceLock::new();
    let ok =
        *REGISTERED.get_or_init(|| register_font(FAMILY, FontStyle::Normal, DEJAVU_SANS).is_ok());
    if ok {
        Ok(())
    } else {
        Err(PlotError::Font)
    }
}
