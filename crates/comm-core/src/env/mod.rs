//! Rank and world size from the environment a launcher sets.
//!
//! [`LaunchEnv::from_env`] reads, in this order of precedence:
//!
//! 1. torchrun / `dtrun`: `RANK`, `WORLD_SIZE`, optionally `LOCAL_RANK`;
//! 2. Open MPI (`mpirun`): `OMPI_COMM_WORLD_RANK`, `OMPI_COMM_WORLD_SIZE`,
//!    `OMPI_COMM_WORLD_LOCAL_RANK`;
//! 3. PMI (MPICH, Intel MPI, Slurm's PMI): `PMI_RANK`, `PMI_SIZE`, `MPI_LOCALRANKID`;
//! 4. Slurm's `srun` ([`slurm`]): `SLURM_PROCID`, `SLURM_STEP_NUM_TASKS` (or `SLURM_NTASKS`),
//!    `SLURM_LOCALID`, and the local task count from `SLURM_STEP_TASKS_PER_NODE` at
//!    `SLURM_NODEID`; only inside an srun step (`SLURM_STEP_ID` set).
//!
//! The rendezvous store's address comes from `MASTER_ADDR` and `MASTER_PORT` (MPI launchers do
//! not set them; export them yourself); under srun, when they are not set, from the first host
//! of `SLURM_JOB_NODELIST` and a port derived from `SLURM_JOB_ID` ([`slurm::port_of_job`]). A variable that is set but malformed is an
//! error naming it and its value; a missing one is an error listing what was looked for.
//!
//! ```
//! use candle_dtensor::comm::env::{EnvSource, LaunchEnv};
//!
//! let vars = [("RANK", "1"), ("WORLD_SIZE", "4"), ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29500")];
//! let env = LaunchEnv::from_lookup(|k| vars.iter().find(|(n, _)| *n == k).map(|(_, v)| v.to_string()))?;
//! assert_eq!((env.rank, env.world_size, env.source), (1, 4, EnvSource::Torchrun));
//! assert_eq!(env.store_addr()?, "127.0.0.1:29500");
//! # Ok::<(), candle_dtensor::comm::env::EnvError>(())
//! ```

use std::fmt;

use crate::error::CommError;

pub mod slurm;

/// Which launcher convention the rank came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EnvSource {
    /// `RANK` / `WORLD_SIZE` (torchrun, `dtrun`).
    Torchrun,
    /// `OMPI_COMM_WORLD_RANK` / `OMPI_COMM_WORLD_SIZE` (Open MPI).
    OpenMpi,
    /// `PMI_RANK` / `PMI_SIZE` (MPICH, Intel MPI, Slurm).
    Pmi,
    /// `SLURM_PROCID` / `SLURM_NTASKS` (an srun step).
    Slurm,
}

impl fmt::Display for EnvSource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            EnvSource::Torchrun => "RANK/WORLD_SIZE",
            EnvSource::OpenMpi => "OMPI_COMM_WORLD_RANK/OMPI_COMM_WORLD_SIZE",
            EnvSource::Pmi => "PMI_RANK/PMI_SIZE",
            EnvSource::Slurm => "SLURM_PROCID/SLURM_NTASKS",
        })
    }
}

/// A malformed or incomplete launch environment.
#[non_exhaustive]
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EnvError {
    /// A required variable is not set. `looked_for` lists the alternatives tried.
    #[error("launch environment: {what} is not set (looked for {looked_for}); start the program with dtrun, torchrun or mpirun, or set them yourself")]
    Missing {
        /// What is missing ("the rank", "the store address", ...).
        what: &'static str,
        /// The variables tried, in order.
        looked_for: String,
    },
    /// A variable is set but its value is not valid.
    #[error("launch environment: {var}={value:?} is invalid: {reason}")]
    Invalid {
        /// The variable.
        var: &'static str,
        /// Its value.
        value: String,
        /// Why it is invalid.
        reason: String,
    },
    /// The rank is not below the world size.
    #[error("launch environment ({convention}): rank {rank} is out of range for a world of {world_size}")]
    RankOutOfRange {
        /// The rank read.
        rank: usize,
        /// The world size read.
        world_size: usize,
        /// Which convention they came from.
        convention: EnvSource,
    },
}

impl From<EnvError> for CommError {
    fn from(e: EnvError) -> Self {
        CommError::Bootstrap {
            comm: "world".to_string(),
            reason: e.to_string(),
        }
    }
}

/// What a launcher told this process.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LaunchEnv {
    /// This process's rank in the world.
    pub rank: usize,
    /// The number of processes in the world.
    pub world_size: usize,
    /// The rank among the processes of this host, when the launcher says.
    pub local_rank: Option<usize>,
    /// The number of processes on this host, when the launcher says (`LOCAL_WORLD_SIZE`,
    /// `OMPI_COMM_WORLD_LOCAL_SIZE`, `MPI_LOCALNRANKS`).
    pub local_world_size: Option<usize>,
    /// `MASTER_ADDR`, when set.
    pub master_addr: Option<String>,
    /// `MASTER_PORT`, when set.
    pub master_port: Option<u16>,
    /// Which convention `rank` / `world_size` came from.
    pub source: EnvSource,
}

fn parse<T: std::str::FromStr>(var: &'static str, value: String, what: &str) -> Result<T, EnvError>
where
    T::Err: fmt::Display,
{
    value.trim().parse::<T>().map_err(|e| EnvError::Invalid {
        var,
        value: value.clone(),
        reason: format!("expected {what}: {e}"),
    })
}

/// A world of at least one rank that holds `rank`.
fn check_world(
    rank: usize,
    world_size: usize,
    size_var: &'static str,
    convention: EnvSource,
) -> Result<(), EnvError> {
    if world_size == 0 {
        return Err(EnvError::Invalid {
            var: size_var,
            value: "0".into(),
            reason: "a world needs at least one rank".into(),
        });
    }
    if rank >= world_size {
        return Err(EnvError::RankOutOfRange {
            rank,
            world_size,
            convention,
        });
    }
    Ok(())
}

/// `MASTER_PORT`'s value as a port that can be dialled.
fn parse_port(v: String) -> Result<u16, EnvError> {
    let p: u16 = parse("MASTER_PORT", v.clone(), "a TCP port (1-65535)")?;
    if p == 0 {
        return Err(EnvError::Invalid {
            var: "MASTER_PORT",
            value: v,
            reason: "port 0 cannot be dialled".into(),
        });
    }
    Ok(p)
}

impl LaunchEnv {
    /// Reads the process environment; see the module docs.
    ///
    /// # Errors
    ///
    /// [`EnvError`] naming the missing or malformed variable.
    pub fn from_env() -> Result<LaunchEnv, EnvError> {
        Self::from_lookup(|k| std::env::var(k).ok())
    }

    /// Whether a launcher set this process's rank (`RANK`, `OMPI_COMM_WORLD_RANK`,
    /// `PMI_RANK`, or `SLURM_PROCID` inside an srun step), i.e. whether it is one rank of a
    /// launched world rather than a plain run.
    pub fn is_launched() -> bool {
        ["RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK"]
            .iter()
            .any(|v| std::env::var_os(v).is_some())
            || (std::env::var_os("SLURM_PROCID").is_some()
                && std::env::var_os("SLURM_STEP_ID").is_some())
    }

    /// This process's index among the processes of its host: the launcher's local rank, else
    /// the world rank (a single-host launch). The usual choice of GPU is this modulo the
    /// number of visible devices.
    pub fn local_index(&self) -> usize {
        self.local_rank.unwrap_or(self.rank)
    }

    /// Like [`LaunchEnv::from_env`] with variables from `get` (for tests and embedding).
    ///
    /// # Errors
    ///
    /// [`EnvError`] naming the missing or malformed variable.
    pub fn from_lookup(get: impl Fn(&str) -> Option<String>) -> Result<LaunchEnv, EnvError> {
        // (source, rank, world size, local rank, local world size)
        const SCHEMES: [(EnvSource, &str, &str, &str, &str); 3] = [
            (
                EnvSource::Torchrun,
                "RANK",
                "WORLD_SIZE",
                "LOCAL_RANK",
                "LOCAL_WORLD_SIZE",
            ),
            (
                EnvSource::OpenMpi,
                "OMPI_COMM_WORLD_RANK",
                "OMPI_COMM_WORLD_SIZE",
                "OMPI_COMM_WORLD_LOCAL_RANK",
                "OMPI_COMM_WORLD_LOCAL_SIZE",
            ),
            (
                EnvSource::Pmi,
                "PMI_RANK",
                "PMI_SIZE",
                "MPI_LOCALRANKID",
                "MPI_LOCALNRANKS",
            ),
        ];
        let found = SCHEMES.iter().find(|(_, r, ..)| get(r).is_some());
        let Some(&(source, rank_var, size_var, local_rank_var, local_size_var)) = found else {
            if get("SLURM_PROCID").is_some() && get("SLURM_STEP_ID").is_some() {
                return Self::from_slurm(&get);
            }
            return Err(EnvError::Missing {
                what: "the rank",
                looked_for: if get("SLURM_PROCID").is_some() {
                    "RANK, OMPI_COMM_WORLD_RANK, PMI_RANK, SLURM_PROCID inside an srun step \
                     (SLURM_PROCID is set but SLURM_STEP_ID is not: a batch script's own \
                     shell; start the ranks with srun)"
                        .into()
                } else {
                    "RANK, OMPI_COMM_WORLD_RANK, PMI_RANK, SLURM_PROCID".into()
                },
            });
        };
        let rank: usize = parse(rank_var, get(rank_var).unwrap_or_default(), "a rank >= 0")?;
        let world_size: usize = match get(size_var) {
            Some(v) => parse(size_var, v, "a world size >= 1")?,
            None => {
                return Err(EnvError::Missing {
                    what: "the world size",
                    looked_for: size_var.to_string(),
                })
            }
        };
        check_world(rank, world_size, size_var, source)?;
        let local_rank = match get(local_rank_var) {
            Some(v) => Some(parse(local_rank_var, v, "a local rank >= 0")?),
            None => None,
        };
        let local_world_size = match get(local_size_var) {
            Some(v) => match parse(local_size_var, v.clone(), "a local world size >= 1")? {
                0 => {
                    return Err(EnvError::Invalid {
                        var: local_size_var,
                        value: v,
                        reason: "a host runs at least this process".into(),
                    })
                }
                n => Some(n),
            },
            None => None,
        };
        let master_addr = get("MASTER_ADDR").filter(|s| !s.trim().is_empty());
        let master_port = get("MASTER_PORT").map(parse_port).transpose()?;
        Ok(LaunchEnv {
            rank,
            world_size,
            local_rank,
            local_world_size,
            master_addr: master_addr.map(|s| s.trim().to_string()),
            master_port,
            source,
        })
    }

    /// An srun step's world (see [`slurm`]).
    fn from_slurm(get: &impl Fn(&str) -> Option<String>) -> Result<LaunchEnv, EnvError> {
        let int = |var: &'static str, what: &str| -> Result<Option<usize>, EnvError> {
            get(var).map(|v| parse(var, v, what)).transpose()
        };
        let rank = int("SLURM_PROCID", "a rank >= 0")?.unwrap_or_default();
        let (size_var, world_size) = match int("SLURM_STEP_NUM_TASKS", "a task count >= 1")? {
            Some(n) => ("SLURM_STEP_NUM_TASKS", n),
            None => match int("SLURM_NTASKS", "a task count >= 1")? {
                Some(n) => ("SLURM_NTASKS", n),
                None => {
                    return Err(EnvError::Missing {
                        what: "the world size",
                        looked_for: "SLURM_STEP_NUM_TASKS, SLURM_NTASKS".into(),
                    })
                }
            },
        };
        check_world(rank, world_size, size_var, EnvSource::Slurm)?;
        let local_rank = int("SLURM_LOCALID", "a local rank >= 0")?;
        let node = int("SLURM_NODEID", "a node index >= 0")?;
        let per_node = get("SLURM_STEP_TASKS_PER_NODE").or_else(|| get("SLURM_TASKS_PER_NODE"));
        let local_world_size = match (per_node, node) {
            (Some(list), Some(node)) => Some(slurm::tasks_on_node(&list, node).map_err(
                |reason| EnvError::Invalid {
                    var: "SLURM_STEP_TASKS_PER_NODE",
                    value: list.clone(),
                    reason,
                },
            )?),
            _ => None,
        };
        let master_addr = match get("MASTER_ADDR").filter(|s| !s.trim().is_empty()) {
            Some(a) => Some(a.trim().to_string()),
            None => {
                let (var, list) = [
                    "SLURM_STEP_NODELIST",
                    "SLURM_JOB_NODELIST",
                    "SLURM_NODELIST",
                ]
                .iter()
                .find_map(|v| get(v).map(|l| (*v, l)))
                .ok_or(EnvError::Missing {
                    what: "the store address",
                    looked_for: "MASTER_ADDR, SLURM_STEP_NODELIST, SLURM_JOB_NODELIST".into(),
                })?;
                Some(
                    slurm::first_host(&list).map_err(|reason| EnvError::Invalid {
                        var,
                        value: list.clone(),
                        reason,
                    })?,
                )
            }
        };
        let master_port = match get("MASTER_PORT") {
            Some(v) => Some(parse_port(v)?),
            None => match get("SLURM_JOB_ID") {
                Some(id) => Some(slurm::port_of_job(parse("SLURM_JOB_ID", id, "a job id")?)),
                None => None,
            },
        };
        Ok(LaunchEnv {
            rank,
            world_size,
            local_rank,
            local_world_size,
            master_addr,
            master_port,
            source: EnvSource::Slurm,
        })
    }

    /// `MASTER_ADDR:MASTER_PORT`, the address of the rendezvous store (IPv6 literals are
    /// bracketed).
    ///
    /// # Errors
    ///
    /// [`EnvError::Missing`] if either variable is not set.
    pub fn store_addr(&self) -> Result<String, EnvError> {
        let missing = |v: &str| EnvError::Missing {
            what: "the store address",
            looked_for: v.to_string(),
        };
        let host = self
            .master_addr
            .as_deref()
            .ok_or_else(|| missing("MASTER_ADDR"))?;
        let port = self.master_port.ok_or_else(|| missing("MASTER_PORT"))?;
        if host.contains(':') && !host.starts_with('[') {
            Ok(format!("[{host}]:{port}"))
        } else {
            Ok(format!("{host}:{port}"))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env(vars: &[(&str, &str)]) -> Result<LaunchEnv, EnvError> {
        let v: Vec<(String, String)> = vars
            .iter()
            .map(|(a, b)| (a.to_string(), b.to_string()))
            .collect();
        LaunchEnv::from_lookup(move |k| v.iter().find(|(n, _)| n == k).map(|(_, x)| x.clone()))
    }

    #[test]
    fn torchrun_variables() {
        let e = env(&[
            ("RANK", "3"),
            ("WORLD_SIZE", "4"),
            ("LOCAL_RANK", "1"),
            ("LOCAL_WORLD_SIZE", "2"),
            ("MASTER_ADDR", "localhost"),
            ("MASTER_PORT", "1234"),
        ])
        .unwrap();
        assert_eq!(e.rank, 3);
        assert_eq!(e.world_size, 4);
        assert_eq!(e.local_rank, Some(1));
        assert_eq!(e.local_index(), 1);
        assert_eq!(e.local_world_size, Some(2));
        assert_eq!(e.source, EnvSource::Torchrun);
        assert_eq!(e.store_addr().unwrap(), "localhost:1234");
    }

    #[test]
    fn mpi_and_pmi_variables_and_precedence() {
        let e = env(&[
            ("OMPI_COMM_WORLD_RANK", "2"),
            ("OMPI_COMM_WORLD_SIZE", "3"),
            ("OMPI_COMM_WORLD_LOCAL_RANK", "0"),
            ("OMPI_COMM_WORLD_LOCAL_SIZE", "3"),
        ])
        .unwrap();
        assert_eq!((e.rank, e.world_size, e.local_rank), (2, 3, Some(0)));
        assert_eq!(e.local_world_size, Some(3));
        assert_eq!(e.source, EnvSource::OpenMpi);
        let e = env(&[("PMI_RANK", "1"), ("PMI_SIZE", "2")]).unwrap();
        assert_eq!((e.rank, e.world_size, e.source), (1, 2, EnvSource::Pmi));
        // No local rank: one host, the world rank picks the device.
        assert_eq!((e.local_rank, e.local_index()), (None, 1));
        assert_eq!(e.local_world_size, None);
        // torchrun's variables win over MPI's.
        let e = env(&[
            ("RANK", "1"),
            ("WORLD_SIZE", "2"),
            ("PMI_RANK", "0"),
            ("PMI_SIZE", "5"),
        ])
        .unwrap();
        assert_eq!((e.rank, e.world_size), (1, 2));
        assert!(matches!(
            e.store_addr(),
            Err(EnvError::Missing { looked_for, .. }) if looked_for == "MASTER_ADDR"
        ));
        let v6 = env(&[
            ("RANK", "0"),
            ("WORLD_SIZE", "1"),
            ("MASTER_ADDR", "::1"),
            ("MASTER_PORT", "9"),
        ])
        .unwrap();
        assert_eq!(v6.store_addr().unwrap(), "[::1]:9");
    }

    #[test]
    fn missing_and_malformed_values_are_typed_errors() {
        let e = env(&[]).unwrap_err();
        assert!(
            matches!(
                e,
                EnvError::Missing {
                    what: "the rank",
                    ..
                }
            ),
            "{e}"
        );
        assert!(e.to_string().contains("RANK"), "{e}");
        let e = env(&[("RANK", "0")]).unwrap_err();
        assert!(
            matches!(&e, EnvError::Missing { looked_for, .. } if looked_for == "WORLD_SIZE"),
            "{e}"
        );
        let e = env(&[("RANK", "x"), ("WORLD_SIZE", "2")]).unwrap_err();
        assert!(
            matches!(&e, EnvError::Invalid { var: "RANK", value, .. } if value == "x"),
            "{e}"
        );
        let e = env(&[("RANK", "-1"), ("WORLD_SIZE", "2")]).unwrap_err();
        assert!(matches!(e, EnvError::Invalid { var: "RANK", .. }), "{e}");
        let e = env(&[("RANK", "2"), ("WORLD_SIZE", "2")]).unwrap_err();
        assert!(
            matches!(
                e,
                EnvError::RankOutOfRange {
                    rank: 2,
                    world_size: 2,
                    ..
                }
            ),
            "{e}"
        );
        let e = env(&[
            ("RANK", "0"),
            ("WORLD_SIZE", "2"),
            ("LOCAL_WORLD_SIZE", "0"),
        ])
        .unwrap_err();
        assert!(
            matches!(
                e,
                EnvError::Invalid {
                    var: "LOCAL_WORLD_SIZE",
                    ..
                }
            ),
            "{e}"
        );
        let e = env(&[("RANK", "0"), ("WORLD_SIZE", "0")]).unwrap_err();
        assert!(
            matches!(
                e,
                EnvError::Invalid {
                    var: "WORLD_SIZE",
                    ..
                }
            ),
            "{e}"
        );
        let e = env(&[("RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_PORT", "70000")]).unwrap_err();
        assert!(
            matches!(
                e,
                EnvError::Invalid {
                    var: "MASTER_PORT",
                    ..
                }
            ),
            "{e}"
        );
        let e = env(&[("RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_PORT", "0")]).unwrap_err();
        assert!(
            matches!(
                e,
                EnvError::Invalid {
                    var: "MASTER_PORT",
                    ..
                }
            ),
            "{e}"
        );
        let e = env(&[("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "a")]).unwrap_err();
        assert!(
            matches!(
                e,
                EnvError::Invalid {
                    var: "LOCAL_RANK",
                    ..
                }
            ),
            "{e}"
        );
        let c: CommError = e.into();
        assert!(matches!(c, CommError::Bootstrap { .. }));
    }

    #[test]
    fn srun_steps_form_a_world_from_slurm_variables() {
        let step = [
            ("SLURM_STEP_ID", "0"),
            ("SLURM_JOB_ID", "123456"),
            ("SLURM_PROCID", "5"),
            ("SLURM_NTASKS", "8"),
            ("SLURM_STEP_NUM_TASKS", "6"),
            ("SLURM_LOCALID", "1"),
            ("SLURM_NODEID", "2"),
            ("SLURM_STEP_TASKS_PER_NODE", "2(x3)"),
            ("SLURM_JOB_NODELIST", "gpu[07-09]"),
        ];
        let e = env(&step).unwrap();
        assert_eq!(e.source, EnvSource::Slurm);
        assert_eq!(
            (e.rank, e.world_size),
            (5, 6),
            "the step's tasks, not the job's"
        );
        assert_eq!((e.local_rank, e.local_world_size), (Some(1), Some(2)));
        assert_eq!(e.store_addr().unwrap(), "gpu07:18456");
        // MASTER_ADDR / MASTER_PORT win.
        let mut v = step.to_vec();
        v.extend([("MASTER_ADDR", "10.0.0.1"), ("MASTER_PORT", "29500")]);
        assert_eq!(env(&v).unwrap().store_addr().unwrap(), "10.0.0.1:29500");
        // dtrun under srun: torchrun's variables win.
        let mut v = step.to_vec();
        v.extend([("RANK", "0"), ("WORLD_SIZE", "2")]);
        assert_eq!(env(&v).unwrap().source, EnvSource::Torchrun);
        // A batch script's own shell is not a launched rank.
        let batch = [
            ("SLURM_JOB_ID", "7"),
            ("SLURM_PROCID", "0"),
            ("SLURM_NTASKS", "8"),
        ];
        let e = env(&batch).unwrap_err();
        assert!(e.to_string().contains("start the ranks with srun"), "{e}");
        // Malformed values name the variable.
        let mut v = step.to_vec();
        v[8] = ("SLURM_JOB_NODELIST", "gpu[07-");
        let e = env(&v).unwrap_err();
        assert!(e.to_string().contains("SLURM_JOB_NODELIST"), "{e}");
        let mut v = step.to_vec();
        v[2] = ("SLURM_PROCID", "6");
        assert!(matches!(
            env(&v),
            Err(EnvError::RankOutOfRange {
                rank: 6,
                world_size: 6,
                convention: EnvSource::Slurm
            })
        ));
        let mut v = step.to_vec();
        v[6] = ("SLURM_NODEID", "3");
        let e = env(&v).unwrap_err();
        assert!(e.to_string().contains("node 3 is beyond"), "{e}");
    }
}
