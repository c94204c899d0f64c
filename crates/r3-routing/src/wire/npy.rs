//! Minimal NPY reader/writer (format versions 1, 2 and 3) for the element types vLLM sends:
//! `|u1`, `<u2`, `<i2`, `<i4`. C order only. The header is a Python dict literal, parsed here
//! by a small strict parser — never evaluated.

use super::WireDtype;
use crate::RouteError;

const F: &str = "vllm";
const MAGIC: &[u8; 6] = b"\x93NUMPY";

/// A parsed NPY file borrowing its data.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NpyArray<'a> {
    /// NPY format major version (1, 2 or 3).
    pub version: u8,
    /// Element type.
    pub dtype: WireDtype,
    /// Array shape (C order).
    pub shape: Vec<usize>,
    /// Raw little-endian element bytes, exactly `product(shape) * dtype.size()` long.
    pub data: &'a [u8],
}

/// The NPY `descr` string of a dtype.
pub fn descr(dtype: WireDtype) -> &'static str {
    match dtype {
        WireDtype::U8 => "|u1",
        WireDtype::U16 => "<u2",
        WireDtype::I16 => "<i2",
        WireDtype::I32 => "<i4",
    }
}

fn dtype_of_descr(d: &str) -> Result<WireDtype, RouteError> {
    match d {
        "|u1" | "<u1" => Ok(WireDtype::U8),
        "<u2" => Ok(WireDtype::U16),
        "<i2" => Ok(WireDtype::I16),
        "<i4" => Ok(WireDtype::I32),
        other => Err(RouteError::format(
            F,
            format!("npy descr {other:?} not supported (expected |u1, <u2, <i2 or <i4)"),
        )),
    }
}

/// Parses NPY bytes; checks magic, version, header and that the data length matches.
pub fn parse_npy(bytes: &[u8]) -> Result<NpyArray<'_>, RouteError> {
    if bytes.len() < 10 || &bytes[..6] != MAGIC {
        return Err(RouteError::format(F, "not an .npy file (bad magic)"));
    }
    let version = bytes[6];
    let (header_len, header_start): (usize, usize) = match version {
        1 => (usize::from(u16::from_le_bytes([bytes[8], bytes[9]])), 10),
        2 | 3 => {
            let b = bytes
                .get(8..12)
                .ok_or_else(|| RouteError::format(F, "npy header length truncated"))?;
            (u32::from_le_bytes([b[0], b[1], b[2], b[3]]) as usize, 12)
        }
        v => {
            return Err(RouteError::format(
                F,
                format!("npy format version {v} not supported"),
            ))
        }
    };
    let header_end = header_start
        .checked_add(header_len)
        .filter(|&e| e <= bytes.len())
        .ok_or_else(|| RouteError::format(F, "npy header runs past the end of the payload"))?;
    let header = std::str::from_utf8(&bytes[header_start..header_end])
        .map_err(|_| RouteError::format(F, "npy header is not UTF-8"))?;
    if version < 3 && !header.is_ascii() {
        return Err(RouteError::format(F, "npy v1/v2 header must be ASCII"));
    }
    let dict = parse_header_dict(header)?;
    if dict.fortran_order {
        return Err(RouteError::format(
            F,
            "fortran_order arrays are not supported",
        ));
    }
    let dtype = dtype_of_descr(&dict.descr)?;
    let count = dict
        .shape
        .iter()
        .try_fold(1usize, |a, &d| a.checked_mul(d))
        .and_then(|n| n.checked_mul(dtype.size()))
        .ok_or_else(|| RouteError::format(F, "npy shape overflows"))?;
    let data = &bytes[header_end..];
    if data.len() != count {
        return Err(RouteError::format(
            F,
            format!(
                "npy shape {:?} of {} needs {count} data bytes, payload has {}",
                dict.shape,
                descr(dtype),
                data.len()
            ),
        ));
    }
    Ok(NpyArray {
        version,
        dtype,
        shape: dict.shape,
        data,
    })
}

/// Writes an NPY file of the given version (1, 2 or 3); header padded to 64 bytes.
pub fn write_npy(
    dtype: WireDtype,
    shape: &[usize],
    data: &[u8],
    version: u8,
) -> Result<Vec<u8>, RouteError> {
    let dims: Vec<String> = shape.iter().map(|d| d.to_string()).collect();
    let shape_text = match dims.len() {
        1 => format!("({},)", dims[0]),
        _ => format!("({})", dims.join(", ")),
    };
    let mut header = format!(
        "{{'descr': '{}', 'fortran_order': False, 'shape': {shape_text}, }}",
        descr(dtype)
    );
    let prefix = match version {
        1 => 10,
        2 | 3 => 12,
        v => {
            return Err(RouteError::Argument(format!(
                "npy version {v} (expected 1, 2 or 3)"
            )))
        }
    };
    let unpadded = prefix + header.len() + 1;
    header.push_str(&" ".repeat((64 - unpadded % 64) % 64));
    header.push('\n');
    let mut out = Vec::with_capacity(prefix + header.len() + data.len());
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&[version, 0]);
    if version == 1 {
        let len = u16::try_from(header.len())
            .map_err(|_| RouteError::Argument("npy v1 header longer than 65535 bytes".into()))?;
        out.extend_from_slice(&len.to_le_bytes());
    } else {
        out.extend_from_slice(&(header.len() as u32).to_le_bytes());
    }
    out.extend_from_slice(header.as_bytes());
    out.extend_from_slice(data);
    Ok(out)
}

struct HeaderDict {
    descr: String,
    fortran_order: bool,
    shape: Vec<usize>,
}

/// Parses `{'descr': '<i4', 'fortran_order': False, 'shape': (3, 4, 2), }`.
fn parse_header_dict(text: &str) -> Result<HeaderDict, RouteError> {
    let mut p = Parser {
        s: text.trim().as_bytes(),
        i: 0,
    };
    p.expect(b'{')?;
    let (mut descr, mut fortran, mut shape) = (None, None, None);
    loop {
        p.skip_ws();
        if p.eat(b'}') {
            break;
        }
        let key = p.string()?;
        p.skip_ws();
        p.expect(b':')?;
        p.skip_ws();
        match key.as_str() {
            "descr" => descr = Some(p.string()?),
            "fortran_order" => fortran = Some(p.boolean()?),
            "shape" => shape = Some(p.tuple()?),
            other => return Err(p.err(&format!("unexpected header key {other:?}"))),
        }
        p.skip_ws();
        if !p.eat(b',') {
            p.skip_ws();
            p.expect(b'}')?;
            break;
        }
    }
    p.skip_ws();
    if p.i != p.s.len() {
        return Err(p.err("trailing characters after header dict"));
    }
    Ok(HeaderDict {
        descr: descr.ok_or_else(|| p.err("header has no 'descr'"))?,
        fortran_order: fortran.ok_or_else(|| p.err("header has no 'fortran_order'"))?,
        shape: shape.ok_or_else(|| p.err("header has no 'shape'"))?,
    })
}

struct Parser<'a> {
    s: &'a [u8],
    i: usize,
}

impl Parser<'_> {
    fn err(&self, msg: &str) -> RouteError {
        RouteError::format(F, format!("npy header: {msg} (at byte {})", self.i))
    }

    fn skip_ws(&mut self) {
        while self.s.get(self.i).is_some_and(|b| b.is_ascii_whitespace()) {
            self.i += 1;
        }
    }

    fn eat(&mut self, c: u8) -> bool {
        if self.s.get(self.i) == Some(&c) {
            self.i += 1;
            true
        } else {
            false
        }
    }

    fn expect(&mut self, c: u8) -> Result<(), RouteError> {
        if self.eat(c) {
            Ok(())
        } else {
            Err(self.err(&format!("expected '{}'", c as char)))
        }
    }

    fn string(&mut self) -> Result<String, RouteError> {
        let quote = match self.s.get(self.i) {
            Some(&q @ (b'\'' | b'"')) => q,
            _ => return Err(self.err("expected a quoted string")),
        };
        self.i += 1;
        let start = self.i;
        while self.s.get(self.i).is_some_and(|&b| b != quote) {
            self.i += 1;
        }
        if self.i >= self.s.len() {
            return Err(self.err("unterminated string"));
        }
        let out = String::from_utf8_lossy(&self.s[start..self.i]).into_owned();
        self.i += 1;
        Ok(out)
    }

    fn boolean(&mut self) -> Result<bool, RouteError> {
        let rest = &self.s[self.i..];
        if rest.starts_with(b"True") {
            self.i += 4;
            Ok(true)
        } else if rest.starts_with(b"False") {
            self.i += 5;
            Ok(false)
        } else {
            Err(self.err("expected True or False"))
        }
    }

    fn tuple(&mut self) -> Result<Vec<usize>, RouteError> {
        self.expect(b'(')?;
        let mut dims = Vec::new();
        loop {
            self.skip_ws();
            if self.eat(b')') {
                return Ok(dims);
            }
            let start = self.i;
            while self.s.get(self.i).is_some_and(u8::is_ascii_digit) {
                self.i += 1;
            }
            let digits = std::str::from_utf8(&self.s[start..self.i]).unwrap_or("");
            let d = digits
                .parse::<usize>()
                .map_err(|_| self.err("expected a non-negative dimension"))?;
            dims.push(d);
            self.eat(b'L');
            self.skip_ws();
            if !self.eat(b',') {
                self.skip_ws();
                self.expect(b')')?;
                return Ok(dims);
            }
        }
    }
}
