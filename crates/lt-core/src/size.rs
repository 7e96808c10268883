//! Byte sizes as users write them (`80GB`, `24GiB`, `1KiB`, `512`) and as we print them.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

/// A number of bytes, parsed from human input and printed in binary units. Serialized as a plain
/// byte count; read from either a count (`25769803776`) or a size string (`"24GiB"`, as run files
/// and profiles write it).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Default)]
#[serde(transparent)]
pub struct ByteSize(pub u64);

impl<'de> Deserialize<'de> for ByteSize {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Visitor;
        impl serde::de::Visitor<'_> for Visitor {
            type Value = ByteSize;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a byte count or a size such as \"24GiB\"")
            }
            fn visit_u64<E: serde::de::Error>(self, v: u64) -> Result<ByteSize, E> {
                Ok(ByteSize(v))
            }
            fn visit_i64<E: serde::de::Error>(self, v: i64) -> Result<ByteSize, E> {
                u64::try_from(v).map(ByteSize).map_err(|_| E::custom(format!("size {v} is negative")))
            }
            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<ByteSize, E> {
                v.parse().map_err(E::custom)
            }
        }
        d.deserialize_any(Visitor)
    }
}

/// Error from parsing a [`ByteSize`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid size {input:?}: {reason} (examples: 80GB, 24GiB, 512MiB, 1KiB, 4096)")]
pub struct ParseSizeError {
    /// The text that failed to parse.
    pub input: String,
    /// Why it failed.
    pub reason: &'static str,
}

impl ByteSize {
    /// `n` GiB.
    pub const fn gib(n: u64) -> Self {
        Self(n << 30)
    }
    /// `n` MiB.
    pub const fn mib(n: u64) -> Self {
        Self(n << 20)
    }
    /// The size as a float number of bytes.
    pub fn as_f64(self) -> f64 {
        self.0 as f64
    }
}

impl FromStr for ByteSize {
    type Err = ParseSizeError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let err = |reason| ParseSizeError { input: s.to_string(), reason };
        let t = s.trim();
        let split = t.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(t.len());
        let (num, unit) = t.split_at(split);
        if num.is_empty() {
            return Err(err("missing number"));
        }
        let value: f64 = num.parse().map_err(|_| err("bad number"))?;
        // Decimal units follow SI (GB = 1e9) because GPU vendors quote "80 GB" that way; binary
        // units (GiB) are 2^30. A bare number is bytes.
        let mult: f64 = match unit.trim().to_ascii_lowercase().as_str() {
            "" | "b" => 1.0,
            "k" | "kb" => 1e3,
            "m" | "mb" => 1e6,
            "g" | "gb" => 1e9,
            "t" | "tb" => 1e12,
            "kib" => 1024.0,
            "mib" => 1024.0 * 1024.0,
            "gib" => 1024.0 * 1024.0 * 1024.0,
            "tib" => 1024.0 * 1024.0 * 1024.0 * 1024.0,
            _ => return Err(err("unknown unit")),
        };
        let bytes = value * mult;
        if !bytes.is_finite() || bytes < 0.0 || bytes > u64::MAX as f64 {
            return Err(err("out of range"));
        }
        Ok(ByteSize(bytes.round() as u64))
    }
}

impl fmt::Display for ByteSize {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let b = self.0 as f64;
        const UNITS: [(&str, f64); 4] = [
            ("TiB", 1024.0 * 1024.0 * 1024.0 * 1024.0),
            ("GiB", 1024.0 * 1024.0 * 1024.0),
            ("MiB", 1024.0 * 1024.0),
            ("KiB", 1024.0),
        ];
        for (name, scale) in UNITS {
            if b >= scale {
                return write!(f, "{:.2} {name}", b / scale);
            }
        }
        write!(f, "{} B", self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_counts_and_size_strings_and_writes_counts() {
        let v: Vec<ByteSize> = serde_json::from_str(r#"[4096, "24GiB", "80GB"]"#).unwrap();
        assert_eq!(v, [ByteSize(4096), ByteSize::gib(24), ByteSize(80_000_000_000)]);
        assert_eq!(serde_json::to_string(&ByteSize::mib(1)).unwrap(), "1048576");
        let e = serde_json::from_str::<ByteSize>(r#""24 furlongs""#).unwrap_err().to_string();
        assert!(e.contains("24 furlongs"), "{e}");
        assert!(serde_json::from_str::<ByteSize>("-1").is_err());
    }

    #[test]
    fn parses_decimal_binary_and_bare() {
        assert_eq!("80GB".parse::<ByteSize>().unwrap(), ByteSize(80_000_000_000));
        assert_eq!("24GiB".parse::<ByteSize>().unwrap(), ByteSize(24 << 30));
        assert_eq!("1KiB".parse::<ByteSize>().unwrap(), ByteSize(1024));
        assert_eq!("4096".parse::<ByteSize>().unwrap(), ByteSize(4096));
        assert_eq!("1.5 MiB".parse::<ByteSize>().unwrap(), ByteSize(1_572_864));
    }

    #[test]
    fn rejects_garbage() {
        assert!("GB".parse::<ByteSize>().is_err());
        assert!("12 parsecs".parse::<ByteSize>().is_err());
        assert!("1.2.3GB".parse::<ByteSize>().is_err());
    }

    #[test]
    fn displays_binary_units() {
        assert_eq!(ByteSize(24 << 30).to_string(), "24.00 GiB");
        assert_eq!(ByteSize(10).to_string(), "10 B");
    }
}
