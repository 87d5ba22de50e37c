//! Little-endian fixed-width fields: how the algorithms' states are stored in shared data.

/// Writes fields into an `N`-byte array; fields past the end are dropped, never a panic.
pub struct Writer<const N: usize> {
    out: [u8; N],
    at: usize,
}

impl<const N: usize> Writer<N> {
    /// An empty array.
    pub fn new() -> Self {
        Writer { out: [0; N], at: 0 }
    }

    fn put(mut self, bytes: &[u8]) -> Self {
        if let Some(dst) = self.out.get_mut(self.at..self.at + bytes.len()) {
            dst.copy_from_slice(bytes);
        }
        self.at += bytes.len();
        self
    }

    /// Appends a `u64`.
    pub fn u64(self, v: u64) -> Self {
        self.put(&v.to_le_bytes())
    }

    /// Appends a `u32`.
    pub fn u32(self, v: u32) -> Self {
        self.put(&v.to_le_bytes())
    }

    /// The encoded bytes.
    pub fn finish(self) -> [u8; N] {
        self.out
    }
}

/// Reads fields in order; `None` when the bytes run out.
pub struct Reader<'a>(pub &'a [u8]);

impl Reader<'_> {
    /// The next `u64`.
    pub fn u64(&mut self) -> Option<u64> {
        let (b, rest) = self.0.split_first_chunk::<8>()?;
        self.0 = rest;
        Some(u64::from_le_bytes(*b))
    }

    /// The next `u32`.
    pub fn u32(&mut self) -> Option<u32> {
        let (b, rest) = self.0.split_first_chunk::<4>()?;
        self.0 = rest;
        Some(u32::from_le_bytes(*b))
    }

    /// `Some` if every byte was read.
    pub fn end(&self) -> Option<()> {
        self.0.is_empty().then_some(())
    }
}

/// The little-endian `u64` at byte `at` of a fixed-size array; 0 past its end. With a constant
/// offset, once inlined, a plain load: the array's length is known, so no check is left.
#[inline(always)]
pub fn u64_at<const N: usize>(b: &[u8; N], at: usize) -> u64 {
    b.get(at..)
        .and_then(|s| s.first_chunk::<8>())
        .map_or(0, |c| u64::from_le_bytes(*c))
}

/// The little-endian `u32` at byte `at` of a fixed-size array, as [`u64_at`].
#[inline(always)]
pub fn u32_at<const N: usize>(b: &[u8; N], at: usize) -> u32 {
    b.get(at..)
        .and_then(|s| s.first_chunk::<4>())
        .map_or(0, |c| u32::from_le_bytes(*c))
}

/// Writes `v` little-endian at byte `at` of a fixed-size array (nothing past its end), as
/// [`u64_at`] reads it.
#[inline(always)]
pub fn put_u64_at<const N: usize>(b: &mut [u8; N], at: usize, v: u64) {
    if let Some(c) = b.get_mut(at..).and_then(|s| s.first_chunk_mut::<8>()) {
        *c = v.to_le_bytes();
    }
}

/// Writes `v` little-endian at byte `at` of a fixed-size array, as [`put_u64_at`].
#[inline(always)]
pub fn put_u32_at<const N: usize>(b: &mut [u8; N], at: usize, v: u32) {
    if let Some(c) = b.get_mut(at..).and_then(|s| s.first_chunk_mut::<4>()) {
        *c = v.to_le_bytes();
    }
}
