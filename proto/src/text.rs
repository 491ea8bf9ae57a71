//! Text every part shows an operator: an error with its causes on one line, and guest text
//! made safe for a terminal.

/// An error and its causes on one line: `outer: cause: root`.
pub fn error_chain(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut cause = error.source();
    while let Some(e) = cause {
        text.push_str(": ");
        text.push_str(&e.to_string());
        cause = e.source();
    }
    text
}

/// `text` as one line a terminal can show safely: control characters (escape sequences,
/// newlines, NULs) as `?`, at most `limit` characters, and `…` when it was cut. Both ends
/// apply it to what the guest names: the agent to what it reads from `/proc`, the host to
/// what the agent says.
pub fn printable(text: &str, limit: usize) -> String {
    let mut shown: String = text
        .chars()
        .map(|c| if c.is_control() { '?' } else { c })
        .take(limit)
        .collect();
    if text.chars().nth(limit).is_some() {
        shown.push('…');
    }
    shown
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, thiserror::Error)]
    #[error("outer")]
    struct Outer(#[source] std::io::Error);

    #[test]
    fn an_error_chain_joins_every_cause() {
        let e = Outer(std::io::Error::other("root"));
        assert_eq!(error_chain(&e), "outer: root");
    }

    #[test]
    fn printable_text_has_no_control_characters_and_a_bound() {
        assert_eq!(printable("rping\x1b[2J -c\n", 100), "rping?[2J -c?");
        assert_eq!(printable("abcdef", 3), "abc…");
        assert_eq!(printable("abc", 3), "abc");
    }
}
