//! Durations and byte sizes as people write them, in flags and in the
//! file.

use std::time::Duration;

use super::MIB;

/// Parses `30s`, `10m`, `1h 30m` (humantime).
pub fn parse_duration(text: &str) -> Result<Duration, String> {
    humantime::parse_duration(text)
        .map_err(|e| format!("invalid duration {text:?}: {e} (examples: \"30s\", \"10m\", \"1h 30m\")"))
}

/// Parses a size: bytes (`4096`), or with a binary unit (`512KiB`, `64MiB`,
/// `1GiB`; `K`, `M`, `G` mean the same).
pub fn parse_byte_size(text: &str) -> Result<u64, String> {
    let text = text.trim();
    let digits_end = text.find(|c: char| !c.is_ascii_digit()).unwrap_or(text.len());
    let (number, unit) = text.split_at(digits_end);
    let bad = || format!("invalid size {text:?} (examples: 4096, \"512KiB\", \"64MiB\", \"1GiB\")");
    let number: u64 = number.parse().map_err(|_| bad())?;
    let factor: u64 = match unit.trim() {
        "" | "B" => 1,
        "K" | "KiB" => 1024,
        "M" | "MiB" => MIB,
        "G" | "GiB" => 1024 * MIB,
        _ => return Err(bad()),
    };
    number.checked_mul(factor).ok_or_else(bad)
}

/// Durations as humantime strings (`"30s"`, `"10m"`).
pub(super) mod human_duration {
    use std::time::Duration;

    use serde::{Deserialize as _, Deserializer, Serializer, de::Error as _};

    pub fn serialize<S: Serializer>(value: &Duration, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(&humantime::format_duration(*value).to_string())
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(deserializer: D) -> Result<Duration, D::Error> {
        let text = String::deserialize(deserializer)?;
        super::parse_duration(&text).map_err(D::Error::custom)
    }
}

/// Sizes as an integer of bytes or a string with a unit; written back with
/// the largest unit that divides them exactly.
pub(super) mod byte_size {
    use std::fmt;

    use serde::{Deserializer, Serializer, de};

    use super::super::MIB;

    #[expect(clippy::trivially_copy_pass_by_ref, reason = "the signature serde's `with` requires")]
    pub fn serialize<S: Serializer>(value: &u64, serializer: S) -> Result<S::Ok, S::Error> {
        let units = [(1024 * MIB, "GiB"), (MIB, "MiB"), (1024, "KiB")];
        match units.iter().find(|(factor, _)| *value > 0 && value.is_multiple_of(*factor)) {
            Some((factor, unit)) => serializer.serialize_str(&format!("{}{unit}", value / factor)),
            None => serializer.serialize_u64(*value),
        }
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(deserializer: D) -> Result<u64, D::Error> {
        deserializer.deserialize_any(Visitor)
    }

    struct Visitor;

    impl de::Visitor<'_> for Visitor {
        type Value = u64;

        fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str("a size in bytes, or a string such as \"64MiB\"")
        }

        fn visit_u64<E: de::Error>(self, v: u64) -> Result<u64, E> {
            Ok(v)
        }

        fn visit_i64<E: de::Error>(self, v: i64) -> Result<u64, E> {
            u64::try_from(v).map_err(|_| E::custom(format!("invalid size {v}: negative")))
        }

        fn visit_str<E: de::Error>(self, v: &str) -> Result<u64, E> {
            super::parse_byte_size(v).map_err(E::custom)
        }
    }
}
