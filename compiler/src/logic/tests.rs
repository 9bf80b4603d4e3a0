//! Unit tests for the tricky parts of the JSONLogic compiler and evaluator:
//! scopes, constant folding, the depth limit, truthiness and equality tables.
//! The full behavioural suites live in `tests/jsonlogic_conformance.rs`.

use super::*;
use serde_json::{Value as Json, json};

fn eval_json(rule: Json, data: Json) -> Result<Json, String> {
    let logic = compile(&rule).map_err(|e| format!("compile: {e}"))?;
    let arena = Bump::new();
    let data = Value::from_json(&data, &arena);
    logic
        .eval(data, &arena)
        .map(|v| v.to_json())
        .map_err(|e| e.to_string())
}

fn ok(rule: Json, data: Json) -> Json {
    eval_json(rule.clone(), data).unwrap_or_else(|e| panic!("{rule}: {e}"))
}

#[test]
fn var_reads_root_paths_indices_and_defaults() {
    let data = json!({"a": {"b": [10, {"c": "deep"}]}, "0": "zero-key"});
    assert_eq!(ok(json!({"var": "a.b.1.c"}), data.clone()), json!("deep"));
    assert_eq!(ok(json!({"var": ["a.x", 5]}), data.clone()), json!(5));
    assert_eq!(ok(json!({"var": ""}), json!(3)), json!(3));
    assert_eq!(ok(json!({"var": null}), json!([1])), json!([1]));
    assert_eq!(ok(json!({"var": 1}), json!(["x", "y"])), json!("y"));
    // A numeric segment also names an object key.
    assert_eq!(ok(json!({"var": "0"}), data.clone()), json!("zero-key"));
    // A found null is returned as null, not replaced by the default.
    assert_eq!(
        ok(json!({"var": ["n", 1]}), json!({"n": null})),
        json!(null)
    );
    // A path computed at evaluation time is split then.
    assert_eq!(
        ok(
            json!({"var": {"cat": ["a.", {"var": "k"}]}}),
            json!({"k": "b", "a": {"b": 2}})
        ),
        json!(2)
    );
    assert_eq!(
        ok(json!({"var": [{"if": [true, "a.b.0"]}]}), data),
        json!(10)
    );
}

#[test]
fn var_paths_are_split_at_compile_time() {
    let logic = compile(&json!({"var": "a.b.2"})).unwrap();
    let root = &logic.prog.nodes[logic.root as usize];
    let Node::Var {
        level: 0,
        path,
        default: None,
        ..
    } = root
    else {
        panic!("not a compiled var: {root:?}")
    };
    assert_eq!(path.len(), 3);
    assert_eq!(path[2].index, Some(2));
    // `val` keys are literal: a dot is part of the key.
    let logic = compile(&json!({"val": "a.b"})).unwrap();
    let Node::Var { path, .. } = &logic.prog.nodes[logic.root as usize] else {
        panic!()
    };
    assert_eq!(path.len(), 1);
}

#[test]
fn iterator_scopes() {
    let data = json!({"xs": [1, 2, 3], "k": 10, "people": [{"n": "a", "d": "x"}, {"n": "b", "d": "y"}], "d": "y"});
    // The body sees the element; `[[1], "index"]` is the iteration index and
    // `[[2], …]` (or `[[-2], …]`) the data around the iterator.
    assert_eq!(
        ok(
            json!({"map": [{"var": "xs"}, {"+": [{"val": []}, {"val": [[1], "index"]}]}]}),
            data.clone()
        ),
        json!([1, 3, 5])
    );
    assert_eq!(
        ok(
            json!({"map": [{"var": "xs"}, {"+": [{"val": []}, {"val": [[-2], "k"]}]}]}),
            data.clone()
        ),
        json!([11, 12, 13])
    );
    assert_eq!(
        ok(
            json!({"filter": [{"var": "people"}, {"==": [{"var": "d"}, {"val": [[2], "d"]}]}]}),
            data.clone()
        ),
        json!([{"n": "b", "d": "y"}])
    );
    // Nested iterators: two levels per iterator; climbing past the root stays there.
    assert_eq!(
        ok(
            json!({"map": [[1], {"map": [{"val": [[4], "xs"]}, {"val": [[9], "k"]}]}]}),
            data.clone()
        ),
        json!([[10, 10, 10]])
    );
    // reduce's scope is {current, accumulator}, readable as a whole too.
    assert_eq!(
        ok(
            json!({"reduce": [{"var": "xs"}, {"+": [{"var": "accumulator"}, {"var": "current"}]}, 0]}),
            data.clone()
        ),
        json!(6)
    );
    assert_eq!(
        ok(json!({"reduce": [[7], {"var": ""}, 0]}), json!(null)),
        json!({"current": 7, "accumulator": 0})
    );
    // The quantifiers refuse a non-array; map/filter/reduce treat it as empty.
    assert_eq!(
        ok(json!({"map": [{"var": "nope"}, 1]}), data.clone()),
        json!([])
    );
    assert!(
        eval_json(json!({"some": [{"var": "nope"}, true]}), data)
            .unwrap_err()
            .starts_with("Invalid Arguments")
    );
}

#[test]
fn try_sees_the_error_as_its_data() {
    assert_eq!(
        ok(
            json!({"try": [{"throw": "boom"}, {"val": "type"}]}),
            json!(null)
        ),
        json!("boom")
    );
    assert_eq!(
        ok(
            json!({"try": [{"/": [1, 0]}, {"val": "type"}]}),
            json!(null)
        ),
        json!("NaN")
    );
    assert_eq!(
        ok(
            json!({"try": [{"throw": "x"}, {"val": [[2], "fb"]}]}),
            json!({"fb": 1})
        ),
        json!(1)
    );
    let logic =
        compile(&json!({"try": [{"throw": "a"}, {"throw": {"type": "b", "code": 7}}]})).unwrap();
    let arena = Bump::new();
    let err = logic.eval(Value::Null, &arena).unwrap_err();
    assert_eq!(err.error_type(), Some("b"));
    assert_eq!(err.to_json(), json!({"type": "b", "code": 7}));
    assert_eq!(err.to_string(), r#"thrown: {"type":"b","code":7}"#);
}

#[test]
fn constants_fold() {
    let logic = compile(&json!({"+": [1, {"*": [2, 3]}, {"max": [4, 5]}]})).unwrap();
    assert_eq!(logic.constant(), Some(&json!(12)));
    assert_eq!(
        logic.prog.nodes.len(),
        1,
        "folded sub-rules leave no nodes behind"
    );
    assert!(logic.is_always_true());
    assert!(!compile(&json!({"==": [1, 2]})).unwrap().is_always_true());
    // Partially constant: the constant part folds, the rest stays.
    let logic =
        compile(&json!({"if": [{"var": "x"}, {"cat": ["a", "b"]}, [1, {"-": [3, 1]}]]})).unwrap();
    assert!(logic.constant().is_none());
    assert!(logic.prog.nodes.iter().all(|n| !matches!(
        n,
        Node::Op {
            op: Op::Cat | Op::Sub | Op::Array,
            ..
        }
    )));
    // Literal arrays of constants become one constant.
    assert_eq!(
        compile(&json!([1, {"+": [1, 1]}])).unwrap().constant(),
        Some(&json!([1, 2]))
    );
    // preserve returns its argument unevaluated.
    assert_eq!(
        compile(&json!({"preserve": {"var": "x"}}))
            .unwrap()
            .constant(),
        Some(&json!({"var": "x"}))
    );
}

#[test]
fn failing_constants_fail_at_evaluation_not_compilation() {
    for rule in [
        json!({"throw": "x"}),
        json!({"/": [1, 0]}),
        json!({"+": ["abc"]}),
        json!({"%": [1, 0]}),
    ] {
        let logic = compile(&rule).unwrap_or_else(|e| panic!("{rule} should compile: {e}"));
        assert!(logic.constant().is_none());
        let arena = Bump::new();
        assert!(
            logic.eval(Value::Null, &arena).is_err(),
            "{rule} should fail"
        );
    }
    assert_eq!(
        ok(json!({"try": [{"/": [1, 0]}, 5]}), json!(null)),
        json!(5)
    );
    // An argument list only known at evaluation time is checked then.
    let err = eval_json(json!({"-": {"var": "xs"}}), json!({"xs": []})).unwrap_err();
    assert!(err.starts_with("Invalid Arguments"), "{err}");
    // A constant one is checked at compile time, like a literal list.
    assert!(compile(&json!({"-": {"preserve": []}})).is_err());
}

#[test]
fn compile_errors() {
    let err = compile(&json!({"foo": [1]})).unwrap_err();
    assert_eq!(err.message, "unknown operator 'foo'");
    assert!(compile(&json!({"method": ["x", "toUpperCase"]})).is_err());
    assert!(
        compile(&json!({"if": 5}))
            .unwrap_err()
            .message
            .contains("Invalid Arguments")
    );
    assert!(compile(&json!({"<": [1]})).is_err());
    assert!(compile(&json!({"%": [1]})).is_err());
    assert!(compile(&json!({"map": [null, 1]})).is_err());
}

#[test]
fn nesting_deeper_than_the_limit_is_a_compile_error() {
    let mut rule = json!(1);
    for _ in 0..MAX_DEPTH / 2 {
        rule = json!({"!": [rule]});
    }
    assert!(compile(&rule).is_ok(), "{MAX_DEPTH} levels are allowed");
    let deeper = json!({"!": [rule]});
    let err = compile(&deeper).unwrap_err();
    assert_eq!(
        err.message,
        format!("rule nests deeper than {MAX_DEPTH} levels")
    );
    // Literal data counts too (it is copied recursively at evaluation).
    let mut literal = json!(0);
    for _ in 0..MAX_DEPTH + 1 {
        literal = json!({"a": literal, "b": 1});
    }
    assert!(compile(&json!({"preserve": literal.clone()})).is_err());
    assert!(compile(&literal).is_err());
    // Far deeper than the stack could take is still a clean error.
    let mut huge = json!(1);
    for _ in 0..1_000 {
        huge = json!([huge]);
    }
    assert!(compile(&huge).is_err());
    // serde_json's own recursive drop would overflow on this; leak it instead.
    std::mem::forget(huge);
}

#[test]
fn truthiness_table() {
    let arena = Bump::new();
    let cases = [
        (json!(null), false),
        (json!(false), false),
        (json!(true), true),
        (json!(0), false),
        (json!(0.0), false),
        (json!(-1), true),
        (json!(0.5), true),
        (json!(""), false),
        (json!("0"), true),
        (json!("false"), true),
        (json!([]), false),
        (json!([0]), true),
        (json!({}), true),
    ];
    for (v, want) in cases {
        assert_eq!(truthy(&Value::from_json(&v, &arena)), want, "truthy({v})");
        assert_eq!(ops::truthy_json(&v), want, "truthy_json({v})");
    }
}

#[test]
fn loose_equality_table() {
    let arena = Bump::new();
    let cases = [
        (json!(1), json!(1.0), true),
        (json!(1), json!("1"), true),
        (json!("1.5"), json!(1.5), true),
        (json!(" 2 "), json!(2), true),
        (json!(""), json!(0), true),
        (json!(1), json!(true), true),
        (json!(0), json!(false), true),
        (json!("1"), json!(true), true),
        (json!(null), json!(null), true),
        (json!(null), json!(0), true),
        (json!(null), json!(false), true),
        (json!(null), json!(""), false),
        (json!(null), json!(1), false),
        (json!(null), json!([]), false),
        (json!("a"), json!("a"), true),
        (json!("a"), json!("b"), false),
        (json!([1, 2]), json!([1, 2]), true),
        // NaN in JavaScript, hence unequal; the `==` operator raises NaN.
        (json!(1), json!("A"), false),
        (json!([1]), json!(1), false),
        (json!({}), json!(1), false),
    ];
    for (a, b, want) in cases {
        let (x, y) = (Value::from_json(&a, &arena), Value::from_json(&b, &arena));
        assert_eq!(loose_eq(&x, &y), want, "{a} == {b}");
        assert_eq!(loose_eq(&y, &x), want, "{b} == {a}");
    }
    assert!(
        eval_json(json!({"==": [1, "A"]}), json!(null))
            .unwrap_err()
            .starts_with("NaN")
    );
    assert!(strict_eq(&Value::Int(1), &Value::Float(1.0)));
    assert!(!strict_eq(&Value::Int(1), &Value::Str("1")));
}

#[test]
fn strings() {
    assert_eq!(
        ok(
            json!({"cat": ["a", 1.5, null, true, [1, [2, null]], {}]}),
            json!(null)
        ),
        json!("a1.5true1,2,[object Object]")
    );
    assert_eq!(
        ok(
            json!({"substr": [{"var": "s"}, 1, 2]}),
            json!({"s": "héllo"})
        ),
        json!("él")
    );
    assert_eq!(
        ok(json!({"substr": ["abc", 1e300, -1e300]}), json!(null)),
        json!("")
    );
    assert_eq!(
        ok(json!({"length": {"var": "s"}}), json!({"s": "héllo"})),
        json!(5)
    );
    assert_eq!(
        ok(
            json!({"in": [{"var": "x"}, ["b", "a", "c"]]}),
            json!({"x": "a"})
        ),
        json!(true)
    );
    assert_eq!(
        ok(
            json!({"in": [{"var": "x"}, ["b", "a", "c"]]}),
            json!({"x": 1})
        ),
        json!(false)
    );
    let logic = compile(&json!({"in": [{"var": "x"}, ["b", "a", "c"]]})).unwrap();
    assert!(matches!(
        logic.prog.nodes[logic.root as usize],
        Node::InStrs { .. }
    ));
}

#[test]
fn missing_keys() {
    let logic = compile(&json!({"missing": ["a", "b.c", "d"]})).unwrap();
    assert!(matches!(
        logic.prog.nodes[logic.root as usize],
        Node::Missing { .. }
    ));
    assert_eq!(
        ok(
            json!({"missing": ["a", "b.c", "d"]}),
            json!({"a": 1, "b": {"c": ""}})
        ),
        json!(["b.c", "d"])
    );
    assert_eq!(
        ok(json!({"missing_some": [1, ["a", "b"]]}), json!({"b": 1})),
        json!([])
    );
    assert_eq!(
        ok(
            json!({"missing": {"var": "keys"}}),
            json!({"keys": ["x", "y"], "y": 0})
        ),
        json!(["x"])
    );
}

#[test]
fn runaway_allocation_is_an_error() {
    // Each step doubles the string: 2^40 bytes without the budget.
    let rule = json!({"reduce": [{"var": "xs"}, {"cat": [{"var": "accumulator"}, {"var": "accumulator"}]}, "ab"]});
    let data = json!({"xs": vec![0; 40]});
    let err = eval_json(rule, data).unwrap_err();
    assert!(err.contains("allocation budget"), "{err}");
}

/// Integral doubles from 2^53 up print as JavaScript's `String()` does: the
/// shortest digits padded with zeros, not the binary value's exact digits
/// (which made `in` disagree with `==` on the same pair).
#[test]
fn large_integral_doubles_print_like_javascript() {
    for (rule, text) in [
        (
            json!({"cat": [{"*": [1.1, 1e20]}]}),
            "110000000000000020000",
        ),
        (
            json!({"cat": [{"*": [123456789, 1000000000000i64]}]}),
            "123456789000000000000",
        ),
        (
            json!({"cat": [999999999999999900000.0]}),
            "999999999999999900000",
        ),
        (json!({"cat": [9007199254740991.0]}), "9007199254740991"),
        (json!({"cat": [-9007199254740992.0]}), "-9007199254740992"),
        (json!({"cat": [1e21]}), "1e+21"),
    ] {
        assert_eq!(ok(rule.clone(), json!({})), json!(text), "{rule}");
    }
    assert_eq!(
        ok(
            json!({"in": [{"*": [1.1, 1e20]}, "110000000000000020000"]}),
            json!({})
        ),
        json!(true)
    );
}

/// A negative fractional length is subtracted before truncating, as the
/// reference implementation does.
#[test]
fn substr_negative_fractional_lengths_follow_json_logic_js() {
    for (rule, text) in [
        (json!({"substr": ["jsonlogic", 1, -2.9]}), "sonlo"),
        (json!({"substr": ["abc", 0, -0.5]}), "ab"),
        (json!({"substr": ["jsonlogic", 4, -2]}), "log"),
        (json!({"substr": ["jsonlogic", -5, -2]}), "log"),
        (json!({"substr": ["abc", 1, -5]}), ""),
    ] {
        assert_eq!(ok(rule.clone(), json!({})), json!(text), "{rule}");
    }
}

/// `substr`'s start and length and `missing_some`'s count are coerced as
/// JavaScript coerces them: an array through its string form (`[1]` is 1),
/// anything that is not a number is NaN. A NaN count is never reached, so
/// `missing_some` answers what is missing (json-logic-js compares
/// `found >= need`, false for NaN); before, it read NaN as 0 and answered
/// `[]`.
#[test]
fn counts_and_indexes_are_coerced_like_javascript() {
    let data = json!({"s": "abcdef", "one": [1], "two": [1, 2], "t": [true], "x": 1});
    for (rule, want) in [
        (
            json!({"substr": [{"var": "s"}, {"var": "one"}]}),
            json!("bcdef"),
        ),
        (json!({"substr": ["abcdef", [2]]}), json!("cdef")),
        (json!({"substr": [{"var": "s"}, [["3"]]]}), json!("def")),
        (
            json!({"substr": [{"var": "s"}, {"var": "two"}]}),
            json!("abcdef"),
        ),
        (
            json!({"substr": [{"var": "s"}, {"var": "t"}]}),
            json!("abcdef"),
        ),
        (
            json!({"substr": [{"var": "s"}, 1, {"var": "one"}]}),
            json!("b"),
        ),
        (
            json!({"substr": [{"var": "s"}, 1, {"var": "two"}]}),
            json!(""),
        ),
        (json!({"substr": [{"var": "s"}, [], 2]}), json!("ab")),
        (json!({"missing_some": ["a", ["x", "y"]]}), json!(["y"])),
        (
            json!({"missing_some": [{"var": "s"}, ["x", "y"]]}),
            json!(["y"]),
        ),
        (
            json!({"missing_some": [{"var": "one"}, ["x", "y"]]}),
            json!([]),
        ),
        (json!({"missing_some": ["1", ["x", "y"]]}), json!([])),
        (json!({"missing_some": [{}, ["x", "y"]]}), json!(["y"])),
        (json!({"missing_some": ["a", ["x"]]}), json!([])),
        (json!({"missing_some": ["a", {"var": "k"}]}), json!(["y"])),
    ] {
        let mut d = data.clone();
        d["k"] = json!(["x", "y"]);
        assert_eq!(ok(rule.clone(), d), want, "{rule}");
    }
}

/// Allocations the budget did not see (rule arrays, what `filter`
/// reserves) let one rule take gigabytes: a reduce building a 60-element
/// array per inner step took 1.4 GB, nested filters 76 GB of address space.
#[test]
fn every_allocation_counts_against_the_budget() {
    let mut big = vec![json!({"var": "current"})];
    big.extend((0..59).map(|i| json!(i)));
    let arrays = json!({"reduce": [{"var": "xs"},
        {"reduce": [{"val": [[2], "xs"]}, big, 0]}, 0]});
    let data = json!({"xs": (0..1000).collect::<Vec<_>>()});
    let err = eval_json(arrays, data).unwrap_err();
    assert!(err.contains("allocation budget"), "{err}");
    let filters = json!({"filter": [{"var": "xs"}, {"filter": [{"val": [[2], "xs"]},
        {"filter": [{"val": [[4], "xs"]}, {"==": [{"var": ""}, -1]}]}]}]});
    let data = json!({"xs": (0..500).collect::<Vec<_>>()});
    let err = eval_json(filters, data).unwrap_err();
    assert!(err.contains("allocation budget"), "{err}");
}

/// Values share what they are made of: `[x, x]` holds `x` twice in two
/// slots. Charged only for the slots, a rule (or a constant folded at
/// compile time) built a value of 10^10 elements, or 2^60 through a
/// `reduce`, in a few kilobytes, and writing it out never ended.
#[test]
fn values_made_of_copies_of_themselves_are_charged_whole() {
    // Folded at compile time: `map` over ten items of a constant body, ten
    // times over (audit 121). Compiling is quick and folds nothing; the
    // evaluation fails on its budget.
    let mut rule = json!([0, 0, 0, 0, 0, 0, 0, 0, 0, 0]);
    for _ in 0..10 {
        rule = json!({"map": [[0, 0, 0, 0, 0, 0, 0, 0, 0, 0], rule]});
    }
    let logic = compile(&rule).unwrap();
    assert!(logic.constant().is_none());
    let err = eval_json(rule, json!(null)).unwrap_err();
    assert!(err.contains("allocation budget"), "{err}");
    // A reduce whose accumulator is two copies of itself; merge alike.
    for body in [
        json!([{"var": "accumulator"}, {"var": "accumulator"}]),
        json!({"merge": [[{"var": "accumulator"}], [{"var": "accumulator"}]]}),
    ] {
        let rule = json!({"reduce": [{"var": "xs"}, body, [1]]});
        let err = eval_json(rule, json!({"xs": (0..60).collect::<Vec<_>>()})).unwrap_err();
        assert!(err.contains("allocation budget"), "{err}");
    }
    // A reduce pair read whole (`{"var": ""}`) holds the current item and
    // the accumulator: charged as an array of them (review 125: it doubled
    // a value per step uncharged).
    let pairs = json!({"reduce": [{"var": "xs"},
        {"reduce": [{"var": "accumulator"}, [{"var": ""}], {"var": "accumulator"}]}, [0]]});
    let err = eval_json(pairs, json!({"xs": (0..70).collect::<Vec<_>>()})).unwrap_err();
    assert!(err.contains("allocation budget"), "{err}");
    // A value placed in every element of a `map` is measured once per
    // evaluation (review 125: a walk per element), and counted whole in
    // the result: 500 copies of a catalog fit, 5,000 do not.
    let catalog: Vec<Json> = (0..1000).map(|i| json!([i])).collect();
    let rule = json!({"map": [{"var": "items"}, [{"var": ""}, {"val": [[2], "catalog"]}]]});
    let got = eval_json(
        rule.clone(),
        json!({"items": vec![[0]; 500], "catalog": catalog}),
    )
    .unwrap();
    assert_eq!(got.as_array().map(Vec::len), Some(500));
    assert_eq!(got[499][1].as_array().map(Vec::len), Some(1000));
    let catalog: Vec<Json> = (0..1000).map(|i| json!([i])).collect();
    let err = eval_json(rule, json!({"items": vec![[0]; 5000], "catalog": catalog})).unwrap_err();
    assert!(err.contains("allocation budget"), "{err}");
    // Within the budget the same rules work, and count what they hold.
    let rule = json!({"reduce": [{"var": "xs"},
        [{"var": "accumulator"}, {"var": "accumulator"}], [1]]});
    let got = ok(rule, json!({"xs": [1, 2, 3]}));
    assert_eq!(got.to_string().matches('1').count(), 8);
}

#[test]
fn appending_to_an_accumulator_pays_for_what_is_added() {
    // Appending to an accumulator pays for what is added, not again for
    // what it holds: 700 objects of about 400 bytes each (the slots of
    // the copies `merge` makes cost 6 MB; charging their trees at every
    // step, 98 MB, passed the budget).
    let item: Json = (0..12)
        .map(|i| (format!("field{i}"), json!("value")))
        .collect::<serde_json::Map<_, _>>()
        .into();
    let mut data = json!({"xs": vec![0; 700]});
    data["item"] = item;
    let rule = json!({"reduce": [{"var": "xs"},
        {"merge": [{"var": "accumulator"}, [{"val": [[2], "item"]}]]}, []]});
    let got = eval_json(rule, data).unwrap();
    assert_eq!(got.as_array().map(Vec::len), Some(700));
}

/// A reduce that wraps its accumulator once per element nests as deep as
/// its array is long; past 4,096 levels it fails instead of building a
/// value whose walks (stringifying, equality, writing) overflow the stack.
#[test]
fn reduce_cannot_nest_values_without_bound() {
    // Deep values are walked recursively (to_json here); debug frames are
    // large, so the test runs on a stack like the service's debug workers.
    std::thread::Builder::new()
        .stack_size(256 << 20)
        .spawn(reduce_nesting)
        .unwrap()
        .join()
        .unwrap();
}

fn reduce_nesting() {
    let wrap = json!({"reduce": [{"var": "xs"}, [{"var": "accumulator"}], []]});
    let ok = eval_json(wrap.clone(), json!({"xs": vec![0; 3000]})).unwrap();
    let mut depth = 0;
    let mut v = &ok;
    while let Some(first) = v.as_array().and_then(|a| a.first()) {
        depth += 1;
        v = first;
    }
    assert_eq!(depth, 3000);
    let err = eval_json(json!({"cat": wrap}), json!({"xs": vec![0; 40_000]})).unwrap_err();
    assert!(err.contains("deeper than 4096 levels"), "{err}");
    // A flat accumulator is measured now and then, never refused.
    let flat = json!({"reduce": [{"var": "xs"}, {"merge": [{"var": "accumulator"}, [{"var": "current"}]]}, []]});
    let out = eval_json(flat, json!({"xs": vec![1; 1000]})).unwrap();
    assert_eq!(out.as_array().unwrap().len(), 1000);
}

#[test]
fn scalar_results_allocate_nothing() {
    /// Arena bytes handed out so far (all chunks minus what is left).
    fn used(arena: &Bump) -> usize {
        arena.allocated_bytes() - arena.chunk_capacity()
    }
    let logic =
        compile(&json!({"if": [{"==": [{"var": "x.y"}, 1]}, "yes", {"+": [{"var": "x.y"}, 1]}]}))
            .unwrap();
    let (data, other) = (json!({"x": {"y": 2}}), json!({"x": {"y": 1}}));
    let arena = Bump::new();
    let v = Value::from_json(&data, &arena);
    let before = used(&arena);
    let out = logic.eval(v, &arena).unwrap();
    assert_eq!(used(&arena), before, "evaluation allocated");
    assert_eq!(out.to_json(), json!(3));
    let v = Value::from_json(&other, &arena);
    assert_eq!(logic.eval(v, &arena).unwrap().as_str(), Some("yes"));
}

#[test]
fn missing_over_a_computed_merge_matches_the_general_path() {
    let arena = Bump::new();
    let cases = [
        (
            json!({"missing": {"merge": ["vin", {"if": [{"var": "f"}, ["apr"], []]}]}}),
            json!({"f": true}),
            json!(["vin", "apr"]),
        ),
        (
            json!({"missing": {"merge": ["vin", {"if": [{"var": "f"}, ["apr"], []]}]}}),
            json!({"f": false, "vin": 1}),
            json!([]),
        ),
        (
            json!({"missing": {"merge": [{"var": "xs"}]}}),
            json!({"xs": []}),
            json!([]),
        ),
        (
            json!({"missing": {"merge": [{"var": "xs"}]}}),
            json!(null),
            json!([null]),
        ),
        (
            json!({"missing": {"merge": [{"var": "xs"}, "b"]}}),
            json!({"xs": [["a"]], "b": 1}),
            json!(["a"]),
        ),
    ];
    for (rule, data, want) in cases {
        let logic = compile(&rule).unwrap();
        let got = logic.eval(Value::from_json(&data, &arena), &arena).unwrap();
        assert_eq!(got.to_json(), want, "{rule} on {data}");
    }
}

#[test]
fn predicate_bodies_match_the_general_path() {
    // `{cmp: [{"var": p}, constant]}` under filter/all/some/none compiles
    // to `Body::Pred`; the same test wrapped in `!!` stays general.
    let logic = compile(&json!({"all": [{"var": "xs"}, {"<": [{"var": "q"}, 1]}]})).unwrap();
    let Node::Iter(it) = &logic.prog.nodes[logic.root as usize] else {
        panic!("not an iterator");
    };
    assert!(matches!(it.shape, Body::Pred { op: Op::Lt, .. }));
    let collections = [
        json!([1, 2, 3]),
        json!([3, 2, 1]),
        json!([1.5, 2, -1, 9_007_199_254_740_993_i64]),
        json!(["a", "b", "10", ""]),
        json!([null, true, false, "2", 2, 0]),
        json!([{"q": 1}, {"q": "x"}, {}, {"q": [1]}, {"q": {"r": 1}}, {"q": 2.5}]),
        json!([[1], [2], []]),
        json!([]),
        json!("not an array"),
        json!(null),
    ];
    let constants = [
        json!(1),
        json!(1.5),
        json!(9_007_199_254_740_992_i64),
        json!("2"),
        json!("b"),
        json!(""),
        json!(null),
        json!(true),
        json!(0),
    ];
    let mut checked = 0;
    for iter in ["filter", "all", "some", "none"] {
        for cmp in ["<", "<=", ">", ">=", "==", "!=", "===", "!=="] {
            for path in ["", "q"] {
                for k in &constants {
                    let test = json!({cmp: [{"var": path}, k]});
                    let fast = json!({iter: [{"var": "xs"}, test]});
                    let general = json!({iter: [{"var": "xs"}, {"!!": [test]}]});
                    for xs in &collections {
                        let data = json!({ "xs": xs });
                        assert_eq!(
                            eval_json(fast.clone(), data.clone()),
                            eval_json(general.clone(), data.clone()),
                            "{fast} on {data}"
                        );
                        checked += 1;
                    }
                }
            }
        }
    }
    assert_eq!(checked, 4 * 8 * 2 * 9 * 10);
}

#[test]
fn constant_missing_keys_match_the_computed_path() {
    // Constant keys compile to `Node::Missing` (a bit mask of missing keys,
    // a fallback past 64 keys); keys read from the data take the general
    // path. Both must agree, order included.
    let long: Vec<String> = (0..70).map(|i| format!("k{i}")).collect();
    let key_lists = [
        json!(["a"]),
        json!(["a", "b", "c"]),
        json!(["c", "a", "b.x", "b"]),
        json!(long),
    ];
    let mut long_data = serde_json::Map::new();
    for i in (0..70).step_by(3) {
        long_data.insert(format!("k{i}"), json!(i));
    }
    let datas = [
        json!({}),
        json!(null),
        json!({"a": 1, "b": {"x": ""}, "c": null}),
        json!({"a": "", "b": {"x": 0}, "c": false}),
        json!({"b": [1], "c": "c"}),
        Json::Object(long_data),
    ];
    let mut checked = 0;
    for keys in &key_lists {
        let need_cases = [
            None,
            Some(json!(0)),
            Some(json!(1)),
            Some(json!(2)),
            Some(json!(-1)),
            Some(json!("x")),
        ];
        for need in need_cases {
            let (fast, general) = match &need {
                None => (json!({"missing": keys}), json!({"missing": {"var": "__k"}})),
                Some(n) => (
                    json!({"missing_some": [n, keys]}),
                    json!({"missing_some": [n, {"var": "__k"}]}),
                ),
            };
            let logic = compile(&fast).unwrap();
            assert!(matches!(
                logic.prog.nodes[logic.root as usize],
                Node::Missing { .. }
            ));
            for data in &datas {
                let mut with_keys = data.clone();
                if let Json::Object(m) = &mut with_keys {
                    m.insert("__k".into(), keys.clone());
                } else {
                    continue;
                }
                assert_eq!(
                    eval_json(fast.clone(), data.clone()),
                    eval_json(general.clone(), with_keys),
                    "{fast} on {data}"
                );
                checked += 1;
            }
        }
    }
    assert_eq!(checked, 4 * 6 * 5);
    // Inside `reduce` the keys name members of the frame.
    assert_eq!(
        ok(
            json!({"reduce": [[1], {"missing": ["current", "accumulator", "x"]}, 0]}),
            json!(null)
        ),
        json!(["x"])
    );
}

#[test]
fn computed_var_paths_split_like_constant_ones() {
    // A path read from the data is cut into pieces at evaluation time; it
    // must name what the same path written as a constant names.
    let data = json!({
        "a": {"b": [10, {"c": "deep"}], "": {"": 5}, "#1": "hash"},
        "": {"x": 1},
        "0": "zero",
        "xs": [[1, 2], {"1": "key"}],
    });
    let paths = [
        "a",
        "a.b",
        "a.b.1.c",
        "a.b.0",
        "a.b.2",
        "a.",
        "a..",
        ".x",
        ".",
        "a.#1",
        "a.b.#1",
        "xs.0.1",
        "xs.1.1",
        "xs.#0",
        "0",
        "a.b.01",
        "nope.x",
        "a.b.1.c.d",
        "dot\\.key",
        "a\\.b",
        "..",
        "back\\\\.x",
    ];
    for p in paths {
        let mut with_path = data.clone();
        with_path["__p"] = json!(p);
        assert_eq!(
            eval_json(json!({"var": {"var": "__p"}}), with_path.clone()),
            eval_json(json!({"var": p}), data.clone()),
            "path {p:?}"
        );
        // Inside an iterator the first piece is read from the element.
        let wrapped = json!({"map": [[data.clone()], {"var": {"cat": [{"val": [[2], "__p"]}]}}]});
        assert_eq!(
            eval_json(wrapped, with_path),
            eval_json(json!({"map": [[data.clone()], {"var": p}]}), data.clone()),
            "path {p:?} in map"
        );
    }
}

#[test]
fn rule_arrays_evaluate_each_element() {
    let data = json!({"x": 2, "o": {"k": [1]}});
    assert_eq!(
        ok(json!([1, {"var": "x"}, 3]), data.clone()),
        json!([1, 2, 3])
    );
    assert_eq!(
        ok(
            json!([{"var": "o.k"}, {"+": [{"var": "x"}, 1]}, "s", null, {"var": "nope"}]),
            data.clone()
        ),
        json!([[1], 3, "s", null, null])
    );
    assert_eq!(ok(json!([{"var": "x"}]), data.clone()), json!([2]));
    assert_eq!(
        ok(
            json!({"map": [[1, 2], [{"var": ""}, {"*": [{"var": ""}, 10]}]]}),
            json!(null)
        ),
        json!([[1, 10], [2, 20]])
    );
    // An element's error is the array's error.
    let err = eval_json(json!([1, {"var": "x"}, {"throw": "boom"}]), data).unwrap_err();
    assert!(err.contains("boom"), "{err}");
}

#[test]
fn arithmetic_bodies_match_the_general_path() {
    // Nested two-argument arithmetic over element reads compiles to
    // `Body::Arith` (a postfix program on a stack of numbers); the same body
    // wrapped in a unary `+` (which only coerces a number to itself) stays
    // general. Values, and where one fails the other, must agree.
    let subtotal =
        json!({"+": [{"var": "accumulator"}, {"*": [{"var": "current.p"}, {"var": "current.q"}]}]});
    let logic = compile(&json!({"reduce": [{"var": "xs"}, subtotal, 0]})).unwrap();
    let Node::Iter(it) = &logic.prog.nodes[logic.root as usize] else {
        panic!("not an iterator");
    };
    assert!(matches!(&it.shape, Body::Arith(steps) if steps.len() == 5));
    // Deeper than the program's stack: not a program, still correct.
    let mut deep = json!({"var": "p"});
    for _ in 0..9 {
        deep = json!({"+": [1, deep]});
    }
    let logic = compile(&json!({"map": [{"var": "xs"}, deep.clone()]})).unwrap();
    let Node::Iter(it) = &logic.prog.nodes[logic.root as usize] else {
        panic!("not an iterator");
    };
    assert!(!matches!(it.shape, Body::Arith(_)));

    let bodies = [
        json!({"*": [{"var": "p"}, {"+": [{"var": "q"}, 1]}]}),
        json!({"/": [{"-": [{"var": "p"}, 1]}, {"%": [{"var": "q"}, 3]}]}),
        json!({"-": [{"*": [{"var": "p"}, 0.5]}, {"/": [{"var": "q"}, {"var": "p"}]}]}),
        deep,
    ];
    let reduce_bodies = [
        subtotal,
        json!({"-": [{"*": [{"var": "accumulator"}, 2]}, {"%": [{"var": "current.q"}, {"var": "current.p"}]}]}),
    ];
    let collections = [
        json!([{"p": 1, "q": 2}, {"p": 2.5, "q": 4}, {"p": -3, "q": 0.5}]),
        json!([{"p": "2", "q": "3"}, {"p": null, "q": true}, {"p": false, "q": "1e2"}]),
        json!([{"p": 1, "q": 3}]),
        json!([{"p": 0, "q": 0}]),
        json!([{"p": "x", "q": 1}]),
        json!([{"q": 1}, {}, {"p": [2], "q": [3]}]),
        json!([{"p": {"a": 1}, "q": 1}]),
        json!([{"p": 1e308, "q": 1e308}]),
        json!([]),
        json!("not an array"),
    ];
    let mut checked = 0;
    let mut failed = 0;
    let mut check = |fast: Json, general: Json, xs: &Json| {
        let data = json!({ "xs": xs });
        let (a, b) = (
            eval_json(fast.clone(), data.clone()),
            eval_json(general, data.clone()),
        );
        assert_eq!(a, b, "{fast} on {data}");
        checked += 1;
        failed += usize::from(a.is_err());
    };
    for iter in ["map", "filter", "all", "some", "none"] {
        for body in &bodies {
            for xs in &collections {
                check(
                    json!({iter: [{"var": "xs"}, body]}),
                    json!({iter: [{"var": "xs"}, {"+": [body]}]}),
                    xs,
                );
            }
        }
    }
    for body in &reduce_bodies {
        for init in [json!(0), json!(1.5), json!("2"), json!(null)] {
            for xs in &collections {
                check(
                    json!({"reduce": [{"var": "xs"}, body, init]}),
                    json!({"reduce": [{"var": "xs"}, {"+": [body]}, init]}),
                    xs,
                );
            }
        }
    }
    assert_eq!(checked, 5 * 4 * 10 + 2 * 4 * 10);
    // Division by zero, non-numeric strings and overflow all reach the error.
    assert!(failed > 20, "{failed} failing cases");
}
