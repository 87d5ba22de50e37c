//! gzip without compression: deflate "stored" blocks, one per event, so that each can be
//! decoded as soon as it arrives (std has no compressor, and any gunzip reads them).

use std::io::{self, Write};

const CRC_TABLE: [u32; 256] = {
    let mut t = [0u32; 256];
    let mut i = 0;
    while i < 256 {
        let mut c = i as u32;
        let mut k = 0;
        while k < 8 {
            c = if c & 1 != 0 {
                0xEDB8_8320 ^ (c >> 1)
            } else {
                c >> 1
            };
            k += 1;
        }
        t[i] = c;
        i += 1;
    }
    t
};

/// CRC-32 (gzip's), continued from `crc` (0 to start).
pub fn crc32(crc: u32, bytes: &[u8]) -> u32 {
    let mut c = !crc;
    for &b in bytes {
        c = CRC_TABLE[((c ^ b as u32) & 0xff) as usize] ^ (c >> 8);
    }
    !c
}

/// A gzip encoder that does not compress: what is written until a flush becomes stored
/// blocks, so each event can be decoded as soon as it arrives.
pub struct Gzip<W: Write> {
    inner: W,
    buf: Vec<u8>,
    crc: u32,
    size: u32,
    started: bool,
}

/// The most a stored block holds.
const STORED_MAX: usize = 65_535;

impl<W: Write> Gzip<W> {
    pub fn new(inner: W) -> Gzip<W> {
        Gzip {
            inner,
            buf: Vec::new(),
            crc: 0,
            size: 0,
            started: false,
        }
    }

    fn start(&mut self) -> io::Result<()> {
        if !self.started {
            // Magic, deflate, no flags, no mtime, no extra flags, OS unknown.
            self.inner
                .write_all(&[0x1f, 0x8b, 8, 0, 0, 0, 0, 0, 0, 255])?;
            self.started = true;
        }
        Ok(())
    }

    fn blocks(&mut self) -> io::Result<()> {
        self.start()?;
        for block in self.buf.chunks(STORED_MAX) {
            let len = block.len() as u16;
            let mut head = vec![0u8];
            head.extend_from_slice(&len.to_le_bytes());
            head.extend_from_slice(&(!len).to_le_bytes());
            let mut out = head;
            out.extend_from_slice(block);
            self.inner.write_all(&out)?;
        }
        self.buf.clear();
        Ok(())
    }

    /// Ends the stream (the final block, the CRC and the size); the inner writer back.
    pub fn finish(mut self) -> io::Result<W> {
        self.blocks()?;
        self.inner.write_all(&[1, 0, 0, 0xff, 0xff])?;
        self.inner.write_all(&self.crc.to_le_bytes())?;
        self.inner.write_all(&self.size.to_le_bytes())?;
        self.inner.flush()?;
        Ok(self.inner)
    }
}

impl<W: Write> Write for Gzip<W> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.crc = crc32(self.crc, buf);
        self.size = self.size.wrapping_add(buf.len() as u32);
        self.buf.extend_from_slice(buf);
        if self.buf.len() >= STORED_MAX {
            self.blocks()?;
        }
        Ok(buf.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        if !self.buf.is_empty() {
            self.blocks()?;
        }
        self.inner.flush()
    }
}

/// Decodes a gzip stream of stored blocks (what [`Gzip`] writes), checking its CRC and size;
/// None if it is anything else or broken.
pub fn gunzip_stored(bytes: &[u8]) -> Option<Vec<u8>> {
    if bytes.get(..4)? != [0x1f, 0x8b, 8, 0] {
        return None;
    }
    let mut at = 10;
    let mut out = Vec::new();
    loop {
        let head = *bytes.get(at)?;
        if head >> 1 != 0 {
            return None; // not a stored block
        }
        let len = u16::from_le_bytes([*bytes.get(at + 1)?, *bytes.get(at + 2)?]);
        let nlen = u16::from_le_bytes([*bytes.get(at + 3)?, *bytes.get(at + 4)?]);
        if len != !nlen {
            return None;
        }
        at += 5;
        out.extend_from_slice(bytes.get(at..at + len as usize)?);
        at += len as usize;
        if head & 1 == 1 {
            break;
        }
    }
    let tail = bytes.get(at..)?;
    if tail.len() != 8 {
        return None;
    }
    let crc = u32::from_le_bytes(tail[..4].try_into().ok()?);
    let size = u32::from_le_bytes(tail[4..].try_into().ok()?);
    (crc == crc32(0, &out) && size == out.len() as u32).then_some(out)
}
