//! Test helper: an independent PNG checker that walks the chunk structure, verifies every
//! chunk's CRC-32 and reads the size from IHDR (scratch directories come from
//! r3-test-support).

use std::path::Path;

/// CRC-32 (IEEE 802.3, reflected, polynomial 0xEDB88320) as PNG chunks use it.
fn crc32(bytes: &[u8]) -> u32 {
    let mut crc = 0xFFFF_FFFFu32;
    for &b in bytes {
        crc ^= u32::from(b);
        for _ in 0..8 {
            let mask = (crc & 1).wrapping_neg();
            crc = (crc >> 1) ^ (0xEDB8_8320 & mask);
        }
    }
    !crc
}

fn be32(b: &[u8]) -> u32 {
    u32::from_be_bytes([b[0], b[1], b[2], b[3]])
}

/// Asserts `path` is a structurally valid PNG of `width` x `height` with image data.
pub fn assert_png(path: &Path, width: u32, height: u32) {
    let bytes = std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    assert_eq!(&bytes[..8], b"\x89PNG\r\n\x1a\n", "PNG signature");
    let mut pos = 8;
    let mut kinds = Vec::new();
    while pos < bytes.len() {
        let len = be32(&bytes[pos..]) as usize;
        let kind = &bytes[pos + 4..pos + 8];
        let data = &bytes[pos + 8..pos + 8 + len];
        let stored = be32(&bytes[pos + 8 + len..]);
        assert_eq!(
            crc32(&bytes[pos + 4..pos + 8 + len]),
            stored,
            "CRC of chunk {kind:?}"
        );
        if kind == b"IHDR" {
            assert_eq!((be32(data), be32(&data[4..])), (width, height), "IHDR size");
        }
        kinds.push(String::from_utf8_lossy(kind).into_owned());
        pos += 12 + len;
    }
    assert_eq!(kinds.first().map(String::as_str), Some("IHDR"));
    assert_eq!(kinds.last().map(String::as_str), Some("IEND"));
    assert!(
        kinds.iter().any(|k| k == "IDAT"),
        "no image data: {kinds:?}"
    );
}

#[test]
fn crc32_matches_the_standard_check_value() {
    // The CRC-32 check value of "123456789" is 0xCBF43926 (every CRC catalogue lists it).
    assert_eq!(crc32(b"123456789"), 0xCBF4_3926);
}
