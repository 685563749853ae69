//! The flight recorder writes its dump to `$CANDLE_DTENSOR_FR_DUMP_DIR` when a communicator
//! fails. Its own binary, because it sets a process-wide environment variable.

use std::time::{Duration, Instant};

use candle_core::{DType, Device, Tensor};
use candle_dtensor_comm::{CommError, LocalWorld, ReduceOp, FR_DUMP_DIR_ENV};

#[test]
fn a_timed_out_comm_dumps_its_flight_recorder_to_the_dump_dir() {
    let dir = std::env::temp_dir().join(format!("cdt-fr-dump-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    std::env::set_var(FR_DUMP_DIR_ENV, &dir);
    let got = LocalWorld::new(2)
        .with_name("fr/dump")
        .with_timeout(Duration::from_millis(300))
        .with_bootstrap_timeout(Duration::from_secs(2))
        .launch(|comm| {
            comm.barrier()?.wait()?; // seq 1
            if comm.rank() == 1 {
                return Ok(None); // never joins seq 2
            }
            let x = Tensor::ones(3, DType::F32, &Device::Cpu)?;
            let w = comm.all_reduce(&x, ReduceOp::Sum)?; // seq 2: times out
            let queued = comm.barrier()?; // seq 3: not started when the dump is written
            let e = w.wait().unwrap_err();
            let _ = queued.wait();
            Ok::<_, Box<dyn std::error::Error + Send + Sync>>(Some(e))
        })
        .unwrap_or_else(|e| panic!("{e}"));
    assert!(
        matches!(got[0], Some(CommError::Timeout { .. })),
        "{:?}",
        got[0]
    );

    // The comm name is made file-safe; only the failing rank writes.
    let file = dir.join("fr_fr_dump_rank0.json");
    let start = Instant::now();
    while !file.exists() && start.elapsed() < Duration::from_secs(3) {
        std::thread::sleep(Duration::from_millis(10));
    }
    let text = std::fs::read_to_string(&file)
        .unwrap_or_else(|e| panic!("no dump at {}: {e}", file.display()));
    assert!(!dir.join("fr_fr_dump_rank1.json").exists());
    let _ = std::fs::remove_dir_all(&dir);

    let dump: serde_json::Value = serde_json::from_str(&text).unwrap();
    let states: Vec<(u64, String, String)> = dump["entries"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| {
            (
                e["seq"].as_u64().unwrap(),
                e["op"].as_str().unwrap().to_string(),
                e["state"].as_str().unwrap().to_string(),
            )
        })
        .collect();
    let want = [
        (1, "barrier", "completed"),
        (2, "all_reduce", "timed_out"),
        (3, "barrier", "not_started"),
    ]
    .map(|(s, o, st)| (s, o.to_string(), st.to_string()));
    assert_eq!(states, want, "{text}");
    assert_eq!(dump["entries"][1]["comm"], "fr/dump", "{text}");
}
