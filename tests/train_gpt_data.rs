//! `train_gpt --data`: text files as byte-level tokens or through a tokenizer.json, the
//! held-out split, and end-to-end runs of the example's own `real_main` on a tiny file (FSDP x
//! TP against one device, train and held-out curves in the CSV and SVG, generation,
//! determinism).
#[path = "../examples/train_gpt.rs"]
#[allow(dead_code)]
mod train_gpt;

mod common;

use common::Scratch;
use std::path::Path;

use clap::Parser;
use train_gpt::text::Tokenizer;

const WORDS: [&str; 12] = [
    "the", "cat", "sat", "on", "a", "mat", "and", "dog", "ran", "far", "away", "today",
];

/// Text of `n` words drawn (deterministically) from [`WORDS`], with a non-ASCII word now and
/// then.
fn text(n: usize) -> String {
    (0..n)
        .map(|i| {
            if i % 37 == 5 {
                "héllo"
            } else {
                WORDS[(i * 7 + i / 3) % WORDS.len()]
            }
        })
        .collect::<Vec<_>>()
        .join(" ")
}

/// A word-level tokenizer.json over [`WORDS`] (and an unknown token), written by hand in the
/// format the `tokenizers` crate saves.
fn write_tokenizer(path: &Path) {
    let vocab: Vec<String> = std::iter::once("[UNK]")
        .chain(WORDS)
        .enumerate()
        .map(|(i, w)| format!("\"{w}\":{i}"))
        .collect();
    let json = format!(
        r#"{{"version":"1.0","truncation":null,"padding":null,"added_tokens":[],"normalizer":null,"pre_tokenizer":{{"type":"WhitespaceSplit"}},"post_processor":null,"decoder":null,"model":{{"type":"WordLevel","vocab":{{{}}},"unk_token":"[UNK]"}}}}"#,
        vocab.join(",")
    );
    std::fs::write(path, json).unwrap();
}

#[test]
fn files_become_tokens_bytes_or_through_a_tokenizer() {
    let dir = Scratch::new("tokens");
    let file = dir.path("input.txt");
    std::fs::write(&file, text(40)).unwrap();
    // Byte-level: the file's UTF-8 bytes.
    let bytes = train_gpt::text::corpus(&file, &Tokenizer::Bytes).unwrap();
    assert_eq!(bytes.vocab(), 256);
    let want: Vec<u32> = text(40).bytes().map(u32::from).collect();
    assert_eq!(bytes.tokens(), want.as_slice());
    assert_eq!(Tokenizer::Bytes.decode(bytes.tokens()), text(40));
    // A tokenizer.json: word ids, unknown words as [UNK].
    let tj = dir.path("tokenizer.json");
    write_tokenizer(&tj);
    let tok = Tokenizer::load(Some(&tj)).unwrap();
    assert_eq!(tok.vocab(), WORDS.len() + 1);
    let ids = tok.encode("the cat zebra").unwrap();
    assert_eq!(ids, vec![1, 2, 0]);
    assert_eq!(tok.decode(&[1, 2]), "the cat");
    let words = train_gpt::text::corpus(&file, &tok).unwrap();
    assert_eq!(words.len(), 40);
    assert_eq!(words.vocab(), WORDS.len() + 1);
    // Determinism: the same file gives the same tokens.
    let again = train_gpt::text::corpus(&file, &tok).unwrap();
    assert_eq!(again.fingerprint(), words.fingerprint());
    // Errors name the file: not UTF-8, empty, no such file, a bad tokenizer.json.
    let bad = dir.path("bad.txt");
    std::fs::write(&bad, [b'a', 0xff, b'b']).unwrap();
    let e = train_gpt::text::corpus(&bad, &Tokenizer::Bytes).unwrap_err();
    assert!(
        e.contains("bad.txt") && e.contains("not UTF-8") && e.contains("offset 1"),
        "{e}"
    );
    let empty = dir.path("empty.txt");
    std::fs::write(&empty, "").unwrap();
    let e = train_gpt::text::corpus(&empty, &Tokenizer::Bytes).unwrap_err();
    assert!(e.contains("no tokens"), "{e}");
    let e = train_gpt::text::corpus(&dir.path("missing.txt"), &Tokenizer::Bytes).unwrap_err();
    assert!(e.contains("missing.txt"), "{e}");
    let e = Tokenizer::load(Some(&file)).err().unwrap();
    assert!(e.contains("input.txt"), "{e}");
}

/// `real_main` sizes the gemm threads through a process environment variable: one run at a
/// time, so no other test thread reads the environment while it is written.
static RUN: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn real_main(a: &train_gpt::Args) -> Result<Option<serde_json::Value>, String> {
    let _one = RUN.lock().unwrap_or_else(|e| e.into_inner());
    // The error's text: the run's error, or "check failed: ..." (train_gpt_check.rs tells the
    // two apart).
    train_gpt::real_main(a).map_err(|e| e.to_string())
}

fn args(extra: &[&str]) -> train_gpt::Args {
    let mut v = vec!["train_gpt"];
    v.extend_from_slice(extra);
    train_gpt::Args::try_parse_from(v).unwrap()
}

fn floats(v: &serde_json::Value) -> Vec<f64> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_f64().unwrap())
        .collect()
}

#[test]
fn train_gpt_on_a_tiny_file_end_to_end() {
    let dir = Scratch::new("e2e");
    let file = dir.path("input.txt");
    // About 3000 bytes: the held-out tenth holds two 128-token sequences.
    std::fs::write(&file, text(600)).unwrap();
    let out = dir.path("curves");
    let (f, o) = (file.to_str().unwrap(), out.to_str().unwrap());
    let common = [
        "--data",
        f,
        "--steps",
        "4",
        "--eval-every",
        "2",
        "--eval-batches",
        "1",
        "--sample",
        "6",
        "--out",
        o,
        "--json",
        "--timeout",
        "60",
    ];
    // FSDP over dp=2 x TP over tp=2 (the default mesh), checked against one device.
    let mut a = common.to_vec();
    a.push("--check");
    let s = real_main(&args(&a)).unwrap().unwrap();
    assert_eq!(s["vocab"], 256);
    assert_eq!(floats(&s["losses"]).len(), 4);
    let evals = s["eval_losses"].as_array().unwrap();
    let after: Vec<u64> = evals.iter().map(|e| e[0].as_u64().unwrap()).collect();
    assert_eq!(after, [2, 4], "held-out loss after steps 2 and 4");
    assert!(
        s["max_rel_loss_diff"].as_f64().unwrap() <= 1e-5,
        "{}",
        s["max_rel_loss_diff"]
    );
    assert!(
        s["max_rel_eval_loss_diff"].as_f64().unwrap() <= 1e-5,
        "{}",
        s["max_rel_eval_loss_diff"]
    );
    assert_eq!(s["sample"]["mode"], "greedy");
    assert_eq!(s["sample"]["tokens"].as_array().unwrap().len(), 6);
    assert!(s["sample"]["text"].is_string());
    // The curves: every step's loss, the held-out loss on the rows of steps 2 and 4.
    let csv = std::fs::read_to_string(out.with_extension("csv")).unwrap();
    let rows: Vec<&str> = csv.lines().collect();
    assert_eq!(rows[0], "step,loss,eval_loss");
    assert_eq!(rows.len(), 5);
    for (i, row) in rows[1..].iter().enumerate() {
        let cols: Vec<&str> = row.split(',').collect();
        assert_eq!(cols[0], i.to_string());
        assert_eq!(cols[2].is_empty(), i % 2 == 0, "row {row}");
    }
    let svg = std::fs::read_to_string(out.with_extension("svg")).unwrap();
    assert_eq!(
        svg.matches("<polyline").count(),
        2,
        "train and held-out curves"
    );
    assert!(svg.contains("held-out"));
    // Deterministic: the same flags give the same losses and the same text.
    let t = real_main(&args(&common)).unwrap().unwrap();
    assert_eq!(t["losses"], s["losses"]);
    assert_eq!(t["eval_losses"], s["eval_losses"]);
    assert_eq!(t["sample"], s["sample"]);
    // Sampling with a temperature is seeded: the same seed, the same tokens.
    let hot = [
        "--data",
        f,
        "--steps",
        "2",
        "--sample",
        "6",
        "--out",
        o,
        "--json",
        "--mesh",
        "dp=2",
        "--temperature",
        "1.5",
        "--sample-seed",
        "9",
    ];
    let h1 = real_main(&args(&hot)).unwrap().unwrap();
    let h2 = real_main(&args(&hot)).unwrap().unwrap();
    assert_eq!(h1["sample"]["mode"], "temperature 1.5 (seed 9)");
    assert_eq!(h1["sample"], h2["sample"]);
}

#[test]
fn train_gpt_with_a_tokenizer_json() {
    let dir = Scratch::new("tokenizer");
    let file = dir.path("input.txt");
    // 1500 words: the held-out tenth holds a 128-token sequence and its target.
    std::fs::write(&file, text(1500)).unwrap();
    let tj = dir.path("tokenizer.json");
    write_tokenizer(&tj);
    let o = dir.path("curves");
    let a = args(&[
        "--data",
        file.to_str().unwrap(),
        "--tokenizer",
        tj.to_str().unwrap(),
        "--steps",
        "2",
        "--eval-every",
        "2",
        "--eval-batches",
        "1",
        "--sample",
        "4",
        "--mesh",
        "dp=2,tp=2",
        "--out",
        o.to_str().unwrap(),
        "--json",
        "--check",
    ]);
    let s = real_main(&a).unwrap().unwrap();
    // 13 ids, rounded up to a multiple of tp=2.
    assert_eq!(s["vocab"], 14);
    assert!(s["max_rel_loss_diff"].as_f64().unwrap() <= 1e-5);
    let sample: Vec<u64> = s["sample"]["tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_u64().unwrap())
        .collect();
    assert_eq!(sample.len(), 4);
    // Generated ids stay in the tokenizer's vocabulary (not the padding id 13).
    assert!(sample.iter().all(|&t| t < 13), "{sample:?}");
    // Too little text for a held-out sequence is an error before any rank starts.
    std::fs::write(&file, text(100)).unwrap();
    let e = real_main(&a).unwrap_err();
    assert!(e.contains("at least 129"), "{e}");
    // --tokenizer without --data.
    let e = real_main(&args(&["--tokenizer", "t.json"])).unwrap_err();
    assert!(e.contains("--tokenizer needs --data"), "{e}");
}

/// `--link`: malformed specs, zero or negative bandwidths and dims not in the mesh are refused
/// before any rank starts, naming the dim.
#[test]
fn bad_link_specs_name_the_dim() {
    for (spec, needle) in [
        ("dp=20us:0GBps", "\"dp\""),
        ("dp=20us:-1GBps", "\"dp\""),
        ("dp=20us", "\"dp\""),
        ("tp=2us:5GBps", "\"tp\" is not in --mesh"),
    ] {
        let a = args(&["--mesh", "dp=2", "--steps", "1", "--link", spec]);
        let e = real_main(&a).unwrap_err();
        assert!(e.contains("--link") && e.contains(needle), "{spec}: {e}");
    }
}

/// A rank killed mid-run (`--inject-fault`, a failing rank thread here; a SIGKILLed process
/// under dtrun) and the job started again with `--resume` (what `dtrun --max-restarts` does for
/// process ranks) continues from the latest complete checkpoint and ends with the final loss
/// of an uninterrupted run.
#[test]
fn a_job_killed_mid_run_and_resumed_ends_as_an_uninterrupted_run() {
    let dir = Scratch::new("fault");
    let (ckpt, out) = (dir.path("ckpt"), dir.path("curves"));
    let (c, o) = (ckpt.to_str().unwrap(), out.to_str().unwrap());
    let plain = [
        "--steps",
        "7",
        "--mesh",
        "dp=2",
        "--json",
        "--timeout",
        "30",
        "--out",
        o,
    ];
    let with = |extra: &[&'static str]| {
        let mut v = plain.to_vec();
        v.extend_from_slice(&["--save-dir", c, "--save-every", "3"]);
        v.extend_from_slice(extra);
        args(&v)
    };
    let e = real_main(&with(&["--inject-fault", "rank=1,step=4"])).unwrap_err();
    assert!(
        e.contains("--inject-fault: rank 1 killed after step 4"),
        "{e}"
    );
    let resumed = real_main(&with(&["--resume"])).unwrap().unwrap();
    assert_eq!(
        resumed["start_step"], 3,
        "the checkpoint after step 3, not a partial one"
    );
    let whole = real_main(&args(&plain)).unwrap().unwrap();
    let (a, b) = (
        resumed["final_loss"].as_f64().unwrap(),
        whole["final_loss"].as_f64().unwrap(),
    );
    assert!(
        (a - b).abs() <= 1e-4 * b.abs(),
        "resumed {a} vs uninterrupted {b}"
    );
    // The steps after the checkpoint match one by one too.
    assert_eq!(
        floats(&resumed["losses"]),
        floats(&whole["losses"])[3..].to_vec()
    );
}

#[test]
fn inject_fault_flags_parse_or_name_the_problem() {
    use train_gpt::{parse_fault, Fault, FaultAt, FaultKind};
    assert_eq!(
        parse_fault("rank=2,step=10,kind=hang"),
        Ok(Fault {
            rank: 2,
            at: FaultAt::Step(10),
            kind: FaultKind::Hang
        })
    );
    assert_eq!(
        parse_fault("rank=3,collective=7"),
        Ok(Fault {
            rank: 3,
            at: FaultAt::Collective(7),
            kind: FaultKind::Kill
        })
    );
    assert!(parse_fault("rank=3,collective=0")
        .unwrap_err()
        .contains("count from 1"));
    assert!(parse_fault("rank=3,step=1,collective=2")
        .unwrap_err()
        .contains("exclude each other"));
    assert_eq!(
        parse_fault("step=1,rank=0").map(|f| f.kind),
        Ok(FaultKind::Kill)
    );
    assert!(parse_fault("rank=1")
        .unwrap_err()
        .contains("needs rank=R,step=S or rank=R,collective=N"));
    assert!(parse_fault("rank=1,step=2,kind=melt")
        .unwrap_err()
        .contains("melt"));
    assert!(parse_fault("rank=x,step=2")
        .unwrap_err()
        .contains("rank=\"x\""));
    assert!(parse_fault("color=red")
        .unwrap_err()
        .contains("unknown key"));
}
