//! `explain --pp`: a pipeline schedule's action lists and bubble fraction, simulated with unit
//! costs and, with `--pp-costs`, with a model's own action times; `--pp-schedule all` compares
//! every generator on the same stages, micro-batches and costs.

use candle_dtensor::parallel::pipeline::{sim, CostModel, Schedule, ScheduleKind};

/// `F,B,I,W`: the time of one forward, full backward, input-gradient and weight-gradient
/// backward on one rank's whole share of the model (the `CostModel` units; train_gpt's
/// `pipeline.action_ms` times `--pp-chunks`). Any unit; all four must be finite and >= 0.
pub fn parse_costs(text: &str) -> Result<CostModel, String> {
    let parts: Vec<&str> = text.split(',').map(str::trim).collect();
    let [f, b, i, w] = parts.as_slice() else {
        return Err(format!(
            "--pp-costs {text:?}: four comma-separated numbers F,B,I,W (forward, full backward, \
             input-gradient and weight-gradient backward), got {}",
            parts.len()
        ));
    };
    let num = |name: &str, s: &str| {
        s.parse::<f64>()
            .map_err(|e| format!("--pp-costs {text:?}: {name} {s:?} is not a number: {e}"))
    };
    let cost = CostModel {
        forward: num("F", f)?,
        backward: num("B", b)?,
        backward_input: num("I", i)?,
        backward_weight: num("W", w)?,
        p2p: 0.0,
    };
    cost.check()
        .map_err(|e| format!("--pp-costs {text:?}: {e}"))?;
    Ok(cost)
}

/// The chunks per rank a generator runs with (`virtual_stages` for interleaved 1F1B).
fn chunks(kind: ScheduleKind, virtual_stages: usize) -> usize {
    match kind {
        ScheduleKind::Interleaved1F1B => virtual_stages,
        ScheduleKind::ZeroBubbleV => 2,
        _ => 1,
    }
}

/// The textbook bubble of a generator with unit costs.
fn formula(kind: ScheduleKind, p: usize, m: usize, v: usize) -> f64 {
    match kind {
        ScheduleKind::Interleaved1F1B => sim::bubble_interleaved(p, m, v),
        ScheduleKind::ZeroBubbleH1 => sim::bubble_zb_h1(p, m),
        ScheduleKind::ZeroBubbleV => sim::bubble_zb_v(p, m),
        _ => sim::bubble_gpipe(p, m),
    }
}

/// One schedule's row: its unit-cost bubble and, with `costs`, the bubble and makespan they
/// give (the schedule's own error as `"error"` when its rule refuses `p`, `m`, `v`).
fn row(
    kind: ScheduleKind,
    p: usize,
    m: usize,
    virtual_stages: usize,
    costs: Option<&CostModel>,
    with_actions: bool,
) -> serde_json::Value {
    let v = chunks(kind, virtual_stages);
    let s = match Schedule::generate(kind, p, m, v) {
        Ok(s) => s,
        Err(e) => {
            return serde_json::json!({
                "schedule": kind.to_string(), "p": p, "m": m, "v": v, "error": e.to_string(),
            })
        }
    };
    let unit = CostModel::default();
    let sim_of = |c: &CostModel| {
        s.simulate(c)
            .map(|t| (t.bubble_fraction(), t.makespan))
            .map_err(|e| e.to_string())
    };
    let mut out = serde_json::json!({
        "schedule": kind.to_string(), "p": p, "m": m, "v": v,
        "formula": formula(kind, p, m, v),
    });
    match sim_of(&unit) {
        Ok((b, _)) => out["bubble_fraction"] = serde_json::json!(b),
        Err(e) => out["error"] = serde_json::json!(e),
    }
    if let Some(c) = costs {
        match sim_of(c) {
            Ok((b, t)) => {
                out["costs_bubble_fraction"] = serde_json::json!(b);
                out["costs_makespan"] = serde_json::json!(t);
            }
            Err(e) => out["error"] = serde_json::json!(e),
        }
    }
    if with_actions {
        out["table"] = serde_json::json!(s.table());
        out["ranks"] = serde_json::json!((0..p)
            .map(|r| s
                .actions(r)
                .iter()
                .map(|a| a.to_string())
                .collect::<Vec<_>>())
            .collect::<Vec<_>>());
    }
    out
}

/// The report of `explain --pp p --microbatches m --pp-schedule name`: one schedule (with its
/// action lists), or with `name == "all"` every generator, each simulated with unit costs and
/// with `costs` when given.
pub fn report(
    p: usize,
    m: usize,
    name: &str,
    virtual_stages: usize,
    costs: Option<&CostModel>,
) -> Result<serde_json::Value, String> {
    let cost_json = |c: &CostModel| {
        serde_json::json!({"forward": c.forward, "backward": c.backward,
            "backward_input": c.backward_input, "backward_weight": c.backward_weight})
    };
    let head = serde_json::json!({
        "unit_costs": cost_json(&CostModel::default()),
        "costs": costs.map(cost_json),
    });
    if name.eq_ignore_ascii_case("all") {
        let rows: Vec<serde_json::Value> = ScheduleKind::NAMES
            .iter()
            .filter_map(|n| ScheduleKind::from_name(n).ok())
            .map(|k| row(k, p, m, virtual_stages, costs, false))
            .collect();
        let mut r = head;
        r["schedules"] = serde_json::json!(rows);
        return Ok(r);
    }
    let kind = ScheduleKind::from_name(name).map_err(|e| e.to_string())?;
    let one = row(kind, p, m, virtual_stages, costs, true);
    if let Some(e) = one.get("error") {
        return Err(e.as_str().unwrap_or("the schedule was refused").to_string());
    }
    let mut r = head;
    r["schedule"] = one;
    Ok(r)
}

/// The report as text.
pub fn text(r: &serde_json::Value) -> String {
    let num = |v: &serde_json::Value| v.as_f64().map_or("-".to_string(), |x| format!("{x:.4}"));
    let mut out = String::new();
    let with_costs = !r["costs"].is_null();
    if let Some(s) = r.get("schedule") {
        out.push_str(&format!(
            "schedule {}: p={} ranks, m={} micro-batches, v={} chunks per rank\n",
            s["schedule"].as_str().unwrap_or("?"),
            s["p"],
            s["m"],
            s["v"]
        ));
        out.push_str(
            "F = forward, B = backward, I/W = input-/weight-gradient backward; mb[.chunk]\n",
        );
        out.push_str(s["table"].as_str().unwrap_or(""));
        out.push_str(&format!(
            "bubble fraction {} (unit-time simulation, F=1 B=2 I=1 W=1; formula {})\n",
            num(&s["bubble_fraction"]),
            num(&s["formula"])
        ));
        if with_costs {
            out.push_str(&format!(
                "with --pp-costs: bubble fraction {}, makespan {}\n",
                num(&s["costs_bubble_fraction"]),
                num(&s["costs_makespan"])
            ));
        }
        return out;
    }
    out.push_str(&format!(
        "{:<18} {:>2} {:>8} {:>8}{}\n",
        "schedule",
        "v",
        "formula",
        "unit",
        if with_costs {
            "    costs  makespan"
        } else {
            ""
        }
    ));
    for s in r["schedules"].as_array().into_iter().flatten() {
        let name = s["schedule"].as_str().unwrap_or("?");
        if let Some(e) = s.get("error") {
            out.push_str(&format!(
                "{name:<18} {:>2} refused: {}\n",
                s["v"],
                e.as_str().unwrap_or("?")
            ));
            continue;
        }
        out.push_str(&format!(
            "{name:<18} {:>2} {:>8} {:>8}",
            s["v"],
            num(&s["formula"]),
            num(&s["bubble_fraction"])
        ));
        if with_costs {
            out.push_str(&format!(
                " {:>8} {:>9}",
                num(&s["costs_bubble_fraction"]),
                num(&s["costs_makespan"])
            ));
        }
        out.push('\n');
    }
    out
}
