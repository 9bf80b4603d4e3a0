//! Implementations of the command-line tools that need no server.

use bumpalo::Bump;
use sluice_compiler::{Value, logic};

/// `sluice logic`: compile `rule`, evaluate it against `data`, return the
/// result as JSON text.
pub fn logic(rule: &str, data: &str) -> Result<String, String> {
    let rule: serde_json::Value =
        serde_json::from_str(rule).map_err(|e| format!("--rule is not valid JSON: {e}"))?;
    let data: serde_json::Value =
        serde_json::from_str(data).map_err(|e| format!("--data is not valid JSON: {e}"))?;
    let compiled = logic::compile(&rule).map_err(|e| format!("invalid rule: {}", e.message))?;
    let arena = Bump::new();
    let value = compiled
        .eval(Value::from_json(&data, &arena), &arena)
        .map_err(|e| format!("evaluation failed: {e}"))?;
    Ok(value.to_json_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn evaluates_a_rule() {
        assert_eq!(
            logic(r#"{"+": [1, {"var": "a"}]}"#, r#"{"a": 2}"#).unwrap(),
            "3"
        );
        assert_eq!(logic(r#"{"cat": ["a", "b"]}"#, "{}").unwrap(), "\"ab\"");
    }

    #[test]
    fn reports_bad_input() {
        assert!(
            logic("{", "{}")
                .unwrap_err()
                .contains("--rule is not valid JSON")
        );
        assert!(
            logic("{}", "[")
                .unwrap_err()
                .contains("--data is not valid JSON")
        );
        assert!(
            logic(r#"{"nope": []}"#, "{}")
                .unwrap_err()
                .starts_with("invalid rule")
        );
    }
}
