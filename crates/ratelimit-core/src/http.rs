//! What HTTP itself allows (RFC 9110), for the checks of several floors: the characters of a
//! token (a field name, a method), and a field from elsewhere that may be written as it is.
//! A leaf: it uses no other module of the crate.

/// A character HTTP allows in a token, such as a field name or a method (RFC 9110 `tchar`).
pub fn is_tchar(c: char) -> bool {
    c.is_ascii_alphanumeric() || "!#$%&'*+-.^_`|~".contains(c)
}

/// Whether a header from elsewhere (a rate limit service's answer) may be written to a
/// response as it is: a name of `tchar`s, a value without control characters other than tab
/// (no CR or LF that could split the response, no NUL).
pub fn is_safe_field(name: &str, value: &str) -> bool {
    !name.is_empty()
        && name.chars().all(is_tchar)
        && value
            .bytes()
            .all(|b| b == b'\t' || (b >= 0x20 && b != 0x7f))
}
