//! The `tojson` filter as Hugging Face's `apply_chat_template` defines it:
//! Python's `json.dumps(x, ensure_ascii=False, indent=…, separators=…,
//! sort_keys=…)`. Templates that describe tools (Qwen's, Llama 3.1's,
//! Mistral's) print the schemas with it, and the models were trained on
//! Python's spacing (`{"a": 1, "b": 2}`), not on a compact or HTML-escaped
//! form, so the filter reproduces Python's output byte for byte on the
//! values a request can carry (JSON's shapes).

use minijinja::value::{Kwargs, Value, ValueKind};
use minijinja::{Error, ErrorKind};

/// Deepest nesting printed: a template cannot recurse without bound.
const DEPTH_MAX: usize = 128;

struct Style {
    indent: Option<String>,
    item_sep: String,
    key_sep: String,
    sort_keys: bool,
    ensure_ascii: bool,
}

/// `value | tojson(indent=None, separators=None, sort_keys=False,
/// ensure_ascii=False)`; `indent` may also be the first positional argument.
pub(crate) fn tojson(value: &Value, indent: Option<Value>, kwargs: Kwargs) -> Result<Value, Error> {
    let indent = match indent {
        Some(i) => Some(i),
        None => kwargs.get::<Option<Value>>("indent")?,
    };
    let indent = match indent {
        None => None,
        Some(v) if v.is_none() => None,
        Some(v) => match v.kind() {
            ValueKind::String => Some(v.as_str().unwrap_or("").to_string()),
            _ => {
                let n = usize::try_from(v.clone()).map_err(|_| {
                    Error::new(
                        ErrorKind::InvalidOperation,
                        "tojson: indent must be an integer or a string",
                    )
                })?;
                Some(" ".repeat(n.min(64)))
            }
        },
    };
    // Python: with an indent, items end lines (`,`); without, `, `.
    let (mut item_sep, mut key_sep) = match indent {
        Some(_) => (",".to_string(), ": ".to_string()),
        None => (", ".to_string(), ": ".to_string()),
    };
    if let Some(seps) = kwargs.get::<Option<Value>>("separators")? {
        if !seps.is_none() {
            let a: Vec<Value> = seps.try_iter()?.collect();
            match (
                a.first().and_then(Value::as_str),
                a.get(1).and_then(Value::as_str),
            ) {
                (Some(i), Some(k)) if a.len() == 2 => {
                    item_sep = i.to_string();
                    key_sep = k.to_string();
                }
                _ => {
                    return Err(Error::new(
                        ErrorKind::InvalidOperation,
                        "tojson: separators must be two strings",
                    ))
                }
            }
        }
    }
    let style = Style {
        indent,
        item_sep,
        key_sep,
        sort_keys: kwargs.get::<Option<bool>>("sort_keys")?.unwrap_or(false),
        ensure_ascii: kwargs.get::<Option<bool>>("ensure_ascii")?.unwrap_or(false),
    };
    kwargs.assert_all_used()?;
    let mut out = String::new();
    write(&mut out, value, &style, 0)?;
    Ok(Value::from_safe_string(out))
}

fn newline(out: &mut String, style: &Style, level: usize) {
    if let Some(ind) = &style.indent {
        out.push('\n');
        for _ in 0..level {
            out.push_str(ind);
        }
    }
}

fn write(out: &mut String, v: &Value, style: &Style, level: usize) -> Result<(), Error> {
    if level > DEPTH_MAX {
        return Err(Error::new(
            ErrorKind::InvalidOperation,
            "tojson: nested too deeply",
        ));
    }
    match v.kind() {
        // Python would raise on an undefined value; `null` keeps a template
        // that prints an absent optional member rendering.
        ValueKind::Undefined | ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if v.is_true() { "true" } else { "false" }),
        ValueKind::Number => number(out, v),
        ValueKind::String => string(out, v.as_str().unwrap_or(""), style.ensure_ascii),
        ValueKind::Map => {
            let mut keys: Vec<Value> = v.try_iter()?.collect();
            if keys.is_empty() {
                out.push_str("{}");
                return Ok(());
            }
            if style.sort_keys {
                keys.sort();
            }
            out.push('{');
            for (i, k) in keys.iter().enumerate() {
                if i > 0 {
                    out.push_str(&style.item_sep);
                }
                newline(out, style, level + 1);
                match k.as_str() {
                    Some(s) => string(out, s, style.ensure_ascii),
                    None => string(out, &k.to_string(), style.ensure_ascii),
                }
                out.push_str(&style.key_sep);
                write(out, &v.get_item(k)?, style, level + 1)?;
            }
            newline(out, style, level);
            out.push('}');
        }
        ValueKind::Seq | ValueKind::Iterable => {
            let items: Vec<Value> = v.try_iter()?.collect();
            if items.is_empty() {
                out.push_str("[]");
                return Ok(());
            }
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(&style.item_sep);
                }
                newline(out, style, level + 1);
                write(out, item, style, level + 1)?;
            }
            newline(out, style, level);
            out.push(']');
        }
        _ => string(out, &v.to_string(), style.ensure_ascii),
    }
    Ok(())
}

fn number(out: &mut String, v: &Value) {
    if v.is_integer() {
        // Integers print in full (u64, i128 included).
        out.push_str(&v.to_string());
        return;
    }
    match f64::try_from(v.clone()) {
        Ok(x) if x.is_finite() => {
            // Python's repr: `2.0`, `0.1`, `1e+20`.
            let s = format!("{x:?}");
            match s.split_once('e') {
                Some((m, e)) if !e.starts_with('-') => {
                    out.push_str(m);
                    out.push_str("e+");
                    out.push_str(e);
                }
                _ => out.push_str(&s),
            }
        }
        Ok(x) if x.is_nan() => out.push_str("NaN"),
        Ok(x) if x > 0.0 => out.push_str("Infinity"),
        Ok(_) => out.push_str("-Infinity"),
        Err(_) => out.push_str(&v.to_string()),
    }
}

/// `s` as the inside of a JSON string (`tojson` without the quotes).
pub(crate) fn escaped(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 8);
    string(&mut out, s, false);
    out[1..out.len() - 1].to_string()
}

fn string(out: &mut String, s: &str, ensure_ascii: bool) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 => out.push_str(&format!("\\u{:04x}", c as u32)),
            c if ensure_ascii && !c.is_ascii() => {
                let mut buf = [0u16; 2];
                for u in c.encode_utf16(&mut buf) {
                    out.push_str(&format!("\\u{u:04x}"));
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

#[cfg(test)]
mod tests {
    use minijinja::Environment;

    fn render(src: &str, ctx: minijinja::Value) -> String {
        let mut env = Environment::new();
        env.add_filter("tojson", super::tojson);
        env.add_template("t", src).unwrap();
        env.get_template("t").unwrap().render(ctx).unwrap()
    }

    #[test]
    fn prints_as_pythons_json_dumps_with_ensure_ascii_false() {
        use crate::chat::ordered_map;
        let v = ordered_map(
            [
                ("name".to_string(), minijinja::Value::from("get_weather")),
                (
                    "parameters".to_string(),
                    ordered_map(
                        [
                            ("b".to_string(), minijinja::Value::from(vec![1i64, 2])),
                            ("a".to_string(), minijinja::Value::from(2.5f64)),
                            ("é".to_string(), minijinja::Value::from("<x> \"q\"\n")),
                            ("n".to_string(), minijinja::Value::from(())),
                            ("e".to_string(), minijinja::Value::from(Vec::<i64>::new())),
                        ]
                        .into_iter(),
                    ),
                ),
            ]
            .into_iter(),
        );
        let ctx = minijinja::context! { v => v };
        // Key order kept, Python's spacing, no HTML escaping, unicode as is.
        assert_eq!(
            render("{{ v | tojson }}", ctx.clone()),
            r#"{"name": "get_weather", "parameters": {"b": [1, 2], "a": 2.5, "é": "<x> \"q\"\n", "n": null, "e": []}}"#
        );
        assert_eq!(
            render("{{ v.parameters.b | tojson(indent=2) }}", ctx.clone()),
            "[\n  1,\n  2\n]"
        );
        assert_eq!(
            render(
                "{{ v | tojson(sort_keys=true, separators=[',', ':']) }}",
                ctx.clone()
            ),
            r#"{"name":"get_weather","parameters":{"a":2.5,"b":[1,2],"e":[],"n":null,"é":"<x> \"q\"\n"}}"#
        );
        assert_eq!(
            render(
                "{{ 'é' | tojson(ensure_ascii=true) }} {{ 1.0 | tojson }} {{ 1e20 | tojson }}",
                ctx
            ),
            r#""\u00e9" 1.0 1e+20"#
        );
    }
}
