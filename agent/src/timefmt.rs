//! Serde helpers so reports and journals show times and durations the way a
//! person reads them (RFC 3339, "30s"), and read them back exactly.

/// `SystemTime` as RFC 3339 with nanoseconds, UTC.
pub mod rfc3339 {
    use std::time::SystemTime;

    use serde::{Deserialize, Deserializer, Serializer, de::Error as _};

    pub fn serialize<S: Serializer>(t: &SystemTime, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(&humantime::format_rfc3339_nanos(*t))
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<SystemTime, D::Error> {
        let text = String::deserialize(d)?;
        humantime::parse_rfc3339(&text).map_err(D::Error::custom)
    }
}

/// `Option<SystemTime>` as RFC 3339 or null.
pub mod rfc3339_opt {
    use std::time::SystemTime;

    use serde::{Deserialize, Deserializer, Serializer, de::Error as _};

    pub fn serialize<S: Serializer>(t: &Option<SystemTime>, s: S) -> Result<S::Ok, S::Error> {
        match t {
            Some(t) => s.collect_str(&humantime::format_rfc3339_nanos(*t)),
            None => s.serialize_none(),
        }
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<SystemTime>, D::Error> {
        Option::<String>::deserialize(d)?
            .map(|text| humantime::parse_rfc3339(&text).map_err(D::Error::custom))
            .transpose()
    }
}

/// `Duration` as a humantime string ("30s", "10m", "1h 30m").
pub mod duration {
    use std::time::Duration;

    use serde::{Deserialize, Deserializer, Serializer, de::Error as _};

    pub fn serialize<S: Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(&humantime::format_duration(*d))
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
        let text = String::deserialize(d)?;
        humantime::parse_duration(&text).map_err(D::Error::custom)
    }
}

/// A duration rounded to whole milliseconds, for human-readable reasons.
#[must_use]
pub fn human(d: std::time::Duration) -> String {
    let ms = d.as_millis();
    let rounded = std::time::Duration::from_millis(u64::try_from(ms).unwrap_or(u64::MAX));
    humantime::format_duration(rounded).to_string()
}
