//! `ncclResult_t` -> [`CommError`].
//!
//! During an operation every NCCL failure is fatal for the communicator (a group that some
//! ranks enqueued and others did not cannot be recovered, so the communicator is aborted and
//! the error says so): `ncclTimeout` becomes [`CommError::Timeout`], everything else
//! [`CommError::Aborted`] naming the NCCL function, the code and NCCL's last error. During
//! bootstrap (init, split, windows) failures become [`CommError::Bootstrap`] naming the rank.
//! `ncclInProgress` is never an error: it means "poll `ncclCommGetAsyncError`" (see
//! `engine::wait_ready`).

use super::api::NcclCode;
use candle_dtensor_comm_core::CommError;
use candle_dtensor_comm_core::OpCtx;

/// What went wrong in the words a user can act on, for the codes NCCL documents.
pub fn hint(code: NcclCode) -> &'static str {
    match code {
        NcclCode::UNHANDLED_CUDA_ERROR => "a CUDA call inside NCCL failed",
        NcclCode::SYSTEM_ERROR => "a system call failed (sockets, shared memory, a lost peer)",
        NcclCode::INTERNAL_ERROR => "NCCL hit an internal error",
        NcclCode::INVALID_ARGUMENT => "NCCL rejected an argument",
        NcclCode::INVALID_USAGE => "NCCL was called in an invalid way (ranks disagree?)",
        NcclCode::REMOTE_ERROR => "a peer rank failed or the network broke",
        NcclCode::TIMEOUT => "NCCL timed out",
        NcclCode::UNAVAILABLE => "the loaded NCCL library lacks this function",
        _ => "unknown NCCL status",
    }
}

/// The error of NCCL call `call` failing with `code` during operation `ctx`; `detail` is
/// NCCL's last error (already formatted, may be empty).
pub fn op_error(ctx: &OpCtx, call: &str, code: NcclCode, detail: &str) -> CommError {
    match code {
        NcclCode::TIMEOUT => CommError::Timeout {
            ctx: ctx.clone(),
            timeout: ctx.timeout,
            missing: Vec::new(),
        },
        NcclCode::UNAVAILABLE => CommError::Unsupported {
            backend: "nccl".into(),
            op: format!("{ctx}: {call}"),
        },
        _ => CommError::Aborted {
            ctx: ctx.clone(),
            reason: format!(
                "{call} failed with {code}: {}{detail}; the communicator was aborted",
                hint(code)
            ),
        },
    }
}

/// The error of NCCL call `call` failing with `code` while creating communicator `comm` on
/// `rank`.
pub fn bootstrap_error(
    comm: &str,
    rank: usize,
    call: &str,
    code: NcclCode,
    detail: &str,
) -> CommError {
    CommError::Bootstrap {
        comm: comm.to_string(),
        reason: format!(
            "rank {rank}: {call} failed with {code}: {}{detail}",
            hint(code)
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_dtensor_comm_core::OpName;
    use std::sync::Arc;
    use std::time::Duration;

    fn ctx() -> OpCtx {
        OpCtx {
            op: OpName::AllReduce,
            comm: Arc::from("tp"),
            rank: 3,
            seq: 41,
            timeout: Duration::from_secs(30),
        }
    }

    #[test]
    fn codes_have_names() {
        assert_eq!(NcclCode(6).name(), "ncclRemoteError");
        assert_eq!(NcclCode::IN_PROGRESS.name(), "ncclInProgress");
        assert_eq!(NcclCode(42).name(), "unknown ncclResult_t");
        assert_eq!(NcclCode(2).to_string(), "ncclSystemError (2)");
        assert!(NcclCode::SUCCESS.is_success() && !NcclCode::IN_PROGRESS.is_success());
    }

    #[test]
    fn operation_errors_are_typed_and_fatal() {
        let e = op_error(
            &ctx(),
            "ncclAllReduce",
            NcclCode::REMOTE_ERROR,
            " (peer 2 closed)",
        );
        assert!(matches!(e, CommError::Aborted { .. }));
        assert!(e.is_fatal());
        let m = e.to_string();
        assert!(
            m.starts_with("all_reduce (comm \"tp\", rank 3, seq 41): communicator aborted: ncclAllReduce failed with ncclRemoteError (6)"),
            "{m}"
        );
        assert!(
            m.contains("peer 2 closed") && m.contains("a peer rank failed"),
            "{m}"
        );

        let e = op_error(&ctx(), "ncclGroupEnd", NcclCode::TIMEOUT, "");
        match &e {
            CommError::Timeout {
                timeout,
                missing,
                ctx,
            } => {
                assert_eq!(*timeout, Duration::from_secs(30));
                assert!(missing.is_empty());
                assert_eq!(ctx.seq, 41);
            }
            other => panic!("expected Timeout, got {other:?}"),
        }
        assert!(e.is_fatal());

        let e = op_error(&ctx(), "ncclAlltoAll", NcclCode::UNAVAILABLE, "");
        assert!(matches!(e, CommError::Unsupported { .. }) && !e.is_fatal());

        for code in [1, 2, 3, 4, 5, 77] {
            let e = op_error(&ctx(), "ncclSend", NcclCode(code), "");
            assert!(matches!(e, CommError::Aborted { .. }), "{code}");
        }
    }

    #[test]
    fn bootstrap_errors_name_the_rank() {
        let e = bootstrap_error(
            "world",
            5,
            "ncclCommInitRankConfig",
            NcclCode::SYSTEM_ERROR,
            "",
        );
        let m = e.to_string();
        assert!(matches!(e, CommError::Bootstrap { .. }));
        assert!(
            m.contains("comm \"world\"") && m.contains("rank 5") && m.contains("ncclSystemError"),
            "{m}"
        );
    }
}
