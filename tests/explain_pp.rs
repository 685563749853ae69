//! `explain --pp`: every schedule's unit-cost bubble equals its formula, `--pp-costs` simulates
//! a model's own action times (the unit costs give the unit bubble back; a smaller W than I
//! raises the zero-bubble schedules' bubble, not 1F1B's), `--pp-schedule all` compares every
//! generator and names a refused one's rule, and bad costs are refused naming the value.

#[path = "../examples/common/explain_pp.rs"]
mod explain_pp;

use explain_pp::{parse_costs, report, text};

fn f(v: &serde_json::Value) -> f64 {
    v.as_f64().unwrap_or(f64::NAN)
}

#[test]
fn every_schedule_against_its_formula_and_given_costs() {
    let unit = parse_costs("1,2,1,1").unwrap();
    for p in [2, 4] {
        let r = report(p, 2 * p, "all", 2, Some(&unit)).unwrap();
        let rows = r["schedules"].as_array().unwrap();
        assert_eq!(rows.len(), 5, "{r}");
        for s in rows {
            assert!(s.get("error").is_none(), "{s}");
            let (formula, b) = (f(&s["formula"]), f(&s["bubble_fraction"]));
            assert!((formula - b).abs() < 1e-9, "{s}");
            // The unit costs given explicitly are the unit costs.
            assert!((f(&s["costs_bubble_fraction"]) - b).abs() < 1e-9, "{s}");
            assert!(f(&s["costs_makespan"]) > 0.0, "{s}");
        }
    }
    // W half of I: the zero-bubble schedules' W no longer fills their bubbles, 1F1B's does
    // not depend on the split.
    let cheap_w = parse_costs("1,1.5,1,0.5").unwrap();
    let r = report(4, 8, "all", 2, Some(&cheap_w)).unwrap();
    for s in r["schedules"].as_array().unwrap() {
        let (unit, costs) = (f(&s["bubble_fraction"]), f(&s["costs_bubble_fraction"]));
        match s["schedule"].as_str().unwrap() {
            "ZB-H1" | "ZB-V" => assert!(costs > unit + 1e-3, "{s}"),
            _ => assert!((costs - unit).abs() < 1e-9, "{s}"),
        }
    }
    // One schedule: its action lists and both bubbles, in the text too.
    let r = report(2, 4, "zb-v", 2, Some(&cheap_w)).unwrap();
    let s = &r["schedule"];
    assert_eq!(s["v"], 2, "{r}");
    assert_eq!(s["ranks"].as_array().unwrap().len(), 2, "{r}");
    let t = text(&r);
    assert!(
        t.contains("schedule ZB-V") && t.contains("with --pp-costs"),
        "{t}"
    );
}

#[test]
fn refusals_name_the_rule_or_the_value() {
    // Interleaved needs m % p == 0: refused in the comparison, an error alone.
    let r = report(4, 6, "all", 2, None).unwrap();
    let inter = r["schedules"]
        .as_array()
        .unwrap()
        .iter()
        .find(|s| s["schedule"] == "interleaved-1F1B")
        .unwrap();
    assert!(
        inter["error"].as_str().unwrap().contains("m % p == 0"),
        "{inter}"
    );
    assert!(text(&r).contains("refused"), "{}", text(&r));
    let e = report(4, 6, "interleaved-1f1b", 2, None).unwrap_err();
    assert!(e.contains("m % p == 0"), "{e}");
    assert!(report(2, 4, "dualpipe", 2, None)
        .unwrap_err()
        .contains("zb-v"));
    for (bad, what) in [
        ("1,2,1", "got 3"),
        ("1,2,x,1", "I \"x\" is not a number"),
        ("1,-2,1,1", "backward = -2"),
        ("1,2,NaN,1", "backward_input = NaN"),
    ] {
        let e = parse_costs(bad).unwrap_err();
        assert!(e.contains(what) && e.contains("--pp-costs"), "{bad}: {e}");
    }
}
