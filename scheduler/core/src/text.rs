//! Bounded text: how rota shortens what it keeps or prints within a byte
//! limit. A leaf module: anything may use it, it uses nothing.

/// The longest prefix of `text` within `max_bytes` that ends on a character
/// boundary: how every bounded text (audit records, request ids, messages
/// kept as examples) is shortened without splitting a character.
pub fn prefix_within(text: &str, max_bytes: usize) -> &str {
    let mut end = text.len().min(max_bytes);
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    &text[..end]
}

#[cfg(test)]
mod tests {
    use super::prefix_within;

    #[test]
    fn a_prefix_never_splits_a_character() {
        assert_eq!(prefix_within("abc", 10), "abc");
        assert_eq!(prefix_within("abc", 2), "ab");
        // "é" is two bytes: a cut inside it keeps the text before it.
        assert_eq!(prefix_within("aé", 2), "a");
        assert_eq!(prefix_within("aé", 3), "aé");
        assert_eq!(prefix_within("🙂", 3), "");
        assert_eq!(prefix_within("", 0), "");
    }
}
