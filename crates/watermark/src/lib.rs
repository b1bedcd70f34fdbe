//! Watermarks: Zero's LexiVersion encoding, and the rule by which a source
//! resumes, shared by the host and the source plugins.
//!
//! A LexiVersion is a base-36 length digit followed by the base-36 digits of
//! the value, so byte-wise string order equals numeric order. Sluice itself
//! treats watermarks as opaque strings; only sources decode them.

/// The resume rule of the WIT's `open`: a source reopened at
/// (`watermark`, `replica_version`) continues after `watermark`, unless the
/// two are equal. Then the change log holds nothing past the replica
/// version (the snapshot was never stored), and the source starts over as
/// for a fresh open, with a new snapshot.
pub fn resumes(watermark: &str, replica_version: &str) -> bool {
    watermark != replica_version
}

const DIGITS: &[u8; 36] = b"0123456789abcdefghijklmnopqrstuvwxyz";

/// Encodes `n` as a LexiVersion (`0` -> `"00"`, `36` -> `"110"`).
pub fn to_lexi(n: u128) -> String {
    let mut digits = Vec::with_capacity(26);
    let mut v = n;
    loop {
        digits.push(DIGITS[(v % 36) as usize]);
        v /= 36;
        if v == 0 {
            break;
        }
    }
    digits.push(DIGITS[digits.len() - 1]);
    digits.reverse();
    String::from_utf8(digits).expect("base-36 digits are ASCII")
}

/// Decodes a LexiVersion, rejecting strings whose length prefix does not
/// match (`"0"`, `"20"`, `"3cis1k"`).
pub fn from_lexi(s: &str) -> Option<u128> {
    let (len, rest) = s.as_bytes().split_first()?;
    let len = (*len as char).to_digit(36)? as usize + 1;
    if rest.len() != len || rest.iter().any(|b| b.is_ascii_uppercase()) {
        return None;
    }
    u128::from_str_radix(std::str::from_utf8(rest).ok()?, 36).ok()
}

/// How far watermark `behind` is from `head`, in the units of the
/// LexiVersions they start with (WAL bytes for the Postgres source, the
/// counter for others); anything after a LexiVersion (a source's own
/// suffix, such as MariaDB's GTID position) is ignored. `None` when either
/// does not start with a LexiVersion; 0 when `behind` is not behind.
pub fn distance(behind: &str, head: &str) -> Option<u128> {
    let leading = |w: &str| {
        let len = (*w.as_bytes().first()? as char).to_digit(36)? as usize + 2;
        from_lexi(w.get(..len)?)
    };
    Some(leading(head)?.saturating_sub(leading(behind)?))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn distance_is_measured_on_the_leading_lexiversion() {
        assert_eq!(distance(&to_lexi(100), &to_lexi(1_000_000)), Some(999_900));
        assert_eq!(distance(&to_lexi(7), &to_lexi(7)), Some(0));
        assert_eq!(distance(&to_lexi(9), &to_lexi(7)), Some(0), "ahead is not behind");
        let (a, b) = (format!("{}.0-1-5", to_lexi(5)), format!("{}.0-1-40", to_lexi(40)));
        assert_eq!(distance(&a, &b), Some(35), "a source's suffix is ignored");
        assert_eq!(distance("not-a-lexi", &to_lexi(3)), None);
        assert_eq!(distance("", &to_lexi(3)), None);
    }

    #[test]
    fn encodes_zeros_examples() {
        let cases: &[(u128, &str)] = &[
            (0, "00"),
            (10, "0a"),
            (35, "0z"),
            (36, "110"),
            (46655, "2zzz"),
            (1 << 32, "61z141z4"),
            ((1 << 53) - 1, "a2gosa7pa2gv"),
            (1 << 64, "c3w5e11264sgsg"),
            ((1 << 64) - 1, "c3w5e11264sgsf"),
        ];
        for (n, s) in cases {
            assert_eq!(to_lexi(*n), *s, "encoding {n}");
            assert_eq!(from_lexi(s), Some(*n), "decoding {s}");
        }
    }

    #[test]
    fn rejects_malformed() {
        for bad in ["", "0", "20", "3cis1k", "0A"] {
            assert_eq!(from_lexi(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn a_log_holding_only_the_replica_version_starts_over() {
        assert!(!resumes("0a", "0a"));
        assert!(resumes("0b", "0a"));
    }

    #[test]
    fn order_is_numeric() {
        let mut prev = to_lexi(0);
        for n in [1u128, 9, 35, 36, 1000, 46655, 46656, 1 << 40, 1 << 64] {
            let cur = to_lexi(n);
            assert!(prev < cur, "{prev} < {cur}");
            prev = cur;
        }
    }
}
