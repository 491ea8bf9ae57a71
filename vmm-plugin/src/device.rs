//! Device descriptions as operators write them: `driver=virtio-net-pci,id=nic1,bus=rp1`.
//!
//! QEMU's command line takes every property as a string, but QMP's `device_add` checks JSON
//! types (an integer property given as `"0"` is refused). So the parse keeps the properties
//! that are always names or addresses as strings and turns numbers and `on`/`off` into JSON
//! numbers and booleans. A caller that needs exact types uses the JSON form
//! ([`DeviceSpec::from_properties`]).

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};
use thiserror::Error;

/// Properties whose values are names or addresses, never numbers or flags.
const STRING_PROPERTIES: &[&str] = &[
    "driver", "id", "bus", "netdev", "mac", "romfile", "host", "chardev", "drive", "serial",
    "addr", "sysfsdev", "name",
];

/// A device to plug: QEMU `device_add` properties, `driver` and `id` always present.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(try_from = "Map<String, Value>", into = "Map<String, Value>")]
pub struct DeviceSpec {
    properties: Map<String, Value>,
}

/// Why a device description is not usable.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum DeviceSpecError {
    /// An item of the list is not `key=value`.
    #[error("device property {item:?} is not key=value")]
    NotKeyValue {
        /// The offending item.
        item: String,
    },
    /// A property appears twice.
    #[error("device property {key} is given twice")]
    Duplicate {
        /// The property.
        key: String,
    },
    /// `driver` or `id` is missing or not a non-empty string.
    #[error("device description needs a non-empty string {key}")]
    Missing {
        /// `driver` or `id`.
        key: &'static str,
    },
}

impl DeviceSpec {
    /// Parses `key=value,key=value` (no escaping: values cannot contain commas).
    pub fn parse(text: &str) -> Result<DeviceSpec, DeviceSpecError> {
        let mut properties = Map::new();
        for item in text.split(',').filter(|item| !item.trim().is_empty()) {
            let (key, value) = item
                .split_once('=')
                .filter(|(key, _)| !key.trim().is_empty())
                .ok_or_else(|| DeviceSpecError::NotKeyValue { item: item.into() })?;
            let key = key.trim();
            if properties.contains_key(key) {
                return Err(DeviceSpecError::Duplicate { key: key.into() });
            }
            properties.insert(key.into(), typed_value(key, value));
        }
        DeviceSpec::from_properties(properties)
    }

    /// Takes exact JSON properties, checking that `driver` and `id` are there.
    pub fn from_properties(properties: Map<String, Value>) -> Result<DeviceSpec, DeviceSpecError> {
        for key in ["driver", "id"] {
            match properties.get(key) {
                Some(Value::String(s)) if !s.is_empty() => {}
                _ => return Err(DeviceSpecError::Missing { key }),
            }
        }
        Ok(DeviceSpec { properties })
    }

    /// The device id.
    pub fn id(&self) -> &str {
        self.properties["id"].as_str().unwrap_or_default()
    }

    /// The driver (QEMU device type).
    pub fn driver(&self) -> &str {
        self.properties["driver"].as_str().unwrap_or_default()
    }

    /// All properties, as `device_add` takes them.
    pub fn properties(&self) -> &Map<String, Value> {
        &self.properties
    }
}

impl std::fmt::Display for DeviceSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut first = true;
        for (key, value) in &self.properties {
            if !first {
                f.write_str(",")?;
            }
            first = false;
            match value {
                Value::String(s) => write!(f, "{key}={s}")?,
                Value::Bool(true) => write!(f, "{key}=on")?,
                Value::Bool(false) => write!(f, "{key}=off")?,
                other => write!(f, "{key}={other}")?,
            }
        }
        Ok(())
    }
}

impl std::str::FromStr for DeviceSpec {
    type Err = DeviceSpecError;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        DeviceSpec::parse(text)
    }
}

impl TryFrom<Map<String, Value>> for DeviceSpec {
    type Error = DeviceSpecError;

    fn try_from(properties: Map<String, Value>) -> Result<Self, Self::Error> {
        DeviceSpec::from_properties(properties)
    }
}

impl From<DeviceSpec> for Map<String, Value> {
    fn from(spec: DeviceSpec) -> Self {
        spec.properties
    }
}

fn typed_value(key: &str, value: &str) -> Value {
    if STRING_PROPERTIES.contains(&key) {
        return Value::String(value.into());
    }
    match value {
        "on" | "true" => return Value::Bool(true),
        "off" | "false" => return Value::Bool(false),
        _ => {}
    }
    if let Ok(n) = value.parse::<i64>() {
        return Value::from(n);
    }
    if let Some(hex) = value.strip_prefix("0x") {
        if let Ok(n) = i64::from_str_radix(hex, 16) {
            return Value::from(n);
        }
    }
    Value::String(value.into())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn parses_an_operator_line_with_types() {
        let spec = DeviceSpec::parse(
            "driver=vfio-pci,host=0000:00:02.0,bus=rp1,id=vf1,rombar=0,x-enable=on,romfile=",
        )
        .unwrap();
        assert_eq!(spec.id(), "vf1");
        assert_eq!(spec.driver(), "vfio-pci");
        assert_eq!(
            Value::Object(spec.properties().clone()),
            json!({"driver": "vfio-pci", "host": "0000:00:02.0", "bus": "rp1", "id": "vf1",
                   "rombar": 0, "x-enable": true, "romfile": ""})
        );
    }

    #[test]
    fn names_stay_strings_even_when_numeric() {
        let spec = DeviceSpec::parse("driver=e1000e,id=n1,addr=0x2,serial=123").unwrap();
        assert_eq!(spec.properties()["addr"], json!("0x2"));
        assert_eq!(spec.properties()["serial"], json!("123"));
    }

    #[test]
    fn rejects_bad_lines() {
        assert_eq!(
            DeviceSpec::parse("driver=e1000e,nic0"),
            Err(DeviceSpecError::NotKeyValue {
                item: "nic0".into()
            })
        );
        assert_eq!(
            DeviceSpec::parse("driver=e1000e,=x,id=a"),
            Err(DeviceSpecError::NotKeyValue { item: "=x".into() })
        );
        assert_eq!(
            DeviceSpec::parse("driver=e1000e,id=a,id=b"),
            Err(DeviceSpecError::Duplicate { key: "id".into() })
        );
        assert_eq!(
            DeviceSpec::parse("driver=e1000e"),
            Err(DeviceSpecError::Missing { key: "id" })
        );
        assert_eq!(
            DeviceSpec::parse("id=a,driver="),
            Err(DeviceSpecError::Missing { key: "driver" })
        );
        assert!(DeviceSpec::from_properties(
            json!({"driver": "x", "id": 3}).as_object().unwrap().clone()
        )
        .is_err());
    }

    #[test]
    fn display_and_json_round_trip() {
        let text = "driver=virtio-net-pci,id=nic1,netdev=nd0,bus=rp1,mac=52:54:00:00:00:01";
        let spec = DeviceSpec::parse(text).unwrap();
        assert_eq!(DeviceSpec::parse(&spec.to_string()).unwrap(), spec);
        let json = serde_json::to_string(&spec).unwrap();
        assert_eq!(serde_json::from_str::<DeviceSpec>(&json).unwrap(), spec);
        assert!(serde_json::from_str::<DeviceSpec>(r#"{"id":"x"}"#).is_err());
    }
}
