//! The tools' JSON Schemas, as standard JSON Schema.
//!
//! schemars describes Rust's number types with `format` values of its own
//! (`uint32`, `uint64`, `uint16`, `uint`, `int32`, `double`...). JSON Schema
//! defines no such formats, and strict validators say so: the official
//! TypeScript SDK, which most desktop agents embed, compiles every tool's
//! `outputSchema` with Ajv, which prints `unknown format "uint32" ignored in
//! schema` for each of them, dozens of times per session. What those formats
//! meant is a range, and JSON Schema has words for that.
//!
//! So every schema a tool is listed with (its `inputSchema` from
//! [`crate::args`], its `outputSchema` from `sandpit-core`'s wire types) is
//! made here, by rmcp's generator followed by [`StandardFormats`]: an integer
//! format becomes the Rust type's `minimum`/`maximum` (a range declared with
//! `#[schemars(range(...))]` is kept where it is tighter), and any `format`
//! JSON Schema does not define is dropped. Validation (by serde) does not
//! change; only what clients are told does.

use rmcp::{handler::server::common, model::JsonObject};
use schemars::{
    transform::{transform_subschemas, Transform},
    JsonSchema, Schema,
};
use serde_json::Value;
use std::sync::Arc;

/// A tool's `inputSchema`: the deserialize contract of its argument type.
pub(crate) fn input<T: JsonSchema + 'static>() -> Arc<JsonObject> {
    let schema = common::schema_for_input::<T>()
        .unwrap_or_else(|e| panic!("input schema of {}: {e}", std::any::type_name::<T>()));
    standard(&schema)
}

/// A tool's `outputSchema`: the serialize contract of its result type.
pub(crate) fn output<T: JsonSchema + 'static>() -> Arc<JsonObject> {
    standard(&common::schema_for_output::<T>())
}

fn standard(schema: &JsonObject) -> Arc<JsonObject> {
    let mut schema = Schema::from(schema.clone());
    StandardFormats.transform(&mut schema);
    match schema.to_value() {
        Value::Object(object) => Arc::new(object),
        other => unreachable!("an object schema stays an object: {other}"),
    }
}

/// The `format` values JSON Schema 2020-12 defines (Validation, section 7.3).
const STANDARD_FORMATS: &[&str] = &[
    "date-time",
    "date",
    "time",
    "duration",
    "email",
    "idn-email",
    "hostname",
    "idn-hostname",
    "ipv4",
    "ipv6",
    "uri",
    "uri-reference",
    "iri",
    "iri-reference",
    "uuid",
    "uri-template",
    "json-pointer",
    "relative-json-pointer",
    "regex",
];

/// The range of the Rust integer type schemars names with `format`.
fn integer_range(format: &str) -> Option<(Value, Value)> {
    Some(match format {
        "int8" => (i8::MIN.into(), i8::MAX.into()),
        "int16" => (i16::MIN.into(), i16::MAX.into()),
        "int32" => (i32::MIN.into(), i32::MAX.into()),
        "int64" => (i64::MIN.into(), i64::MAX.into()),
        "int" => (isize::MIN.into(), isize::MAX.into()),
        "uint8" => (0.into(), u8::MAX.into()),
        "uint16" => (0.into(), u16::MAX.into()),
        "uint32" => (0.into(), u32::MAX.into()),
        "uint64" => (0.into(), u64::MAX.into()),
        "uint" => (0.into(), usize::MAX.into()),
        // Beyond what a JSON number holds exactly; the nearest doubles.
        "int128" => ((i128::MIN as f64).into(), (i128::MAX as f64).into()),
        "uint128" => (0.into(), (u128::MAX as f64).into()),
        _ => return None,
    })
}

/// Replaces schemars' non-standard `format` values, in a schema and all its
/// subschemas: an integer format by its type's `minimum`/`maximum`, any other
/// by nothing.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct StandardFormats;

impl Transform for StandardFormats {
    fn transform(&mut self, schema: &mut Schema) {
        if let Some(Value::String(format)) = schema.get("format") {
            let format = format.clone();
            if !STANDARD_FORMATS.contains(&format.as_str()) {
                schema.remove("format");
                if let Some((min, max)) = integer_range(&format) {
                    bound(schema, "minimum", min, |declared, own| declared >= own);
                    bound(schema, "maximum", max, |declared, own| declared <= own);
                }
            }
        }
        transform_subschemas(self, schema);
    }
}

/// Set `keyword` to the type's own bound unless a declared one is within it.
fn bound(schema: &mut Schema, keyword: &str, own: Value, within: fn(f64, f64) -> bool) {
    let declared = schema.get(keyword).and_then(Value::as_f64);
    let own_f = own.as_f64().expect("a bound is a number");
    if !declared.is_some_and(|d| within(d, own_f)) {
        schema.insert(keyword.to_string(), own);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use schemars::json_schema;
    use serde_json::json;

    #[derive(JsonSchema)]
    #[allow(dead_code)]
    struct Numbers {
        a: u8,
        b: u16,
        c: u32,
        d: u64,
        e: usize,
        f: i8,
        g: i16,
        h: i32,
        i: i64,
        j: isize,
        k: f32,
        l: f64,
        m: Option<u32>,
        #[schemars(range(min = 1, max = 1440))]
        n: Option<u32>,
        #[schemars(range(min = 1))]
        o: u32,
        p: Vec<u64>,
        q: std::collections::BTreeMap<String, u16>,
        r: Inner,
        s: std::net::IpAddr,
    }

    #[derive(JsonSchema)]
    #[allow(dead_code)]
    struct Inner {
        x: u32,
    }

    fn schema_of<T: JsonSchema + 'static>() -> Value {
        Value::Object(output::<T>().as_ref().clone())
    }

    #[test]
    fn integers_get_their_type_s_range_and_no_format() {
        let s = schema_of::<Numbers>();
        let range = |field: &str| {
            let p = &s["properties"][field];
            assert!(p.get("format").is_none(), "{field}: {p}");
            (p["minimum"].clone(), p["maximum"].clone())
        };
        assert_eq!(range("a"), (json!(0), json!(255)));
        assert_eq!(range("b"), (json!(0), json!(65535)));
        assert_eq!(range("c"), (json!(0), json!(4294967295u32)));
        assert_eq!(range("d"), (json!(0), json!(u64::MAX)));
        assert_eq!(range("e"), (json!(0), json!(usize::MAX)));
        assert_eq!(range("f"), (json!(-128), json!(127)));
        assert_eq!(range("g"), (json!(-32768), json!(32767)));
        assert_eq!(range("h"), (json!(i32::MIN), json!(i32::MAX)));
        assert_eq!(range("i"), (json!(i64::MIN), json!(i64::MAX)));
        assert_eq!(range("j"), (json!(isize::MIN), json!(isize::MAX)));
        assert_eq!(range("m"), (json!(0), json!(u32::MAX)));
        // Declared ranges are kept, and completed where half is declared.
        assert_eq!(range("n"), (json!(1), json!(1440)));
        assert_eq!(range("o"), (json!(1), json!(u32::MAX)));
        assert_eq!(s["properties"]["m"]["type"], json!(["integer", "null"]));
        // Floats keep their type and lose the format.
        for f in ["k", "l"] {
            assert_eq!(s["properties"][f], json!({"type": "number"}), "{f}");
        }
        // Subschemas: array items, map values, definitions.
        let items = &s["properties"]["p"]["items"];
        assert_eq!(
            items,
            &json!({"type": "integer", "minimum": 0, "maximum": u64::MAX})
        );
        let values = &s["properties"]["q"]["additionalProperties"];
        assert_eq!(
            values,
            &json!({"type": "integer", "minimum": 0, "maximum": 65535})
        );
        let x = &s["$defs"]["Inner"]["properties"]["x"];
        assert_eq!(
            x,
            &json!({"type": "integer", "minimum": 0, "maximum": u32::MAX})
        );
        // schemars' `ip` is not a JSON Schema format either.
        assert_eq!(s["properties"]["s"], json!({"type": "string"}));
    }

    #[test]
    fn a_declared_range_wider_than_the_type_is_narrowed_to_it() {
        let mut s = json_schema!({
            "type": "integer", "format": "uint16", "minimum": -5, "maximum": 70000
        });
        StandardFormats.transform(&mut s);
        assert_eq!(
            s.to_value(),
            json!({"type": "integer", "minimum": 0, "maximum": 65535})
        );
    }

    #[test]
    fn standard_formats_stay() {
        for format in ["date-time", "uri", "email", "uuid"] {
            let mut s = json_schema!({"type": "string", "format": format});
            StandardFormats.transform(&mut s);
            assert_eq!(s.to_value(), json!({"type": "string", "format": format}));
        }
    }

    #[test]
    fn data_that_looks_like_a_schema_is_left_alone() {
        // A property named `format`, and a default value with a `format` key.
        let mut s = json_schema!({
            "type": "object",
            "properties": {"format": {"type": "string", "default": {"format": "uint32"}}}
        });
        let before = s.clone();
        StandardFormats.transform(&mut s);
        assert_eq!(s, before);
    }
}
