//! DeviceMesh conformance: 1-D to 4-D meshes over the local backend, collectives on every
//! mesh dim checked against a brute-force reference layout, slicing, flattening, and errors
//! that name what was valid.

use std::error::Error;
use std::time::Duration;

use candle_core::{Device, Tensor};
use candle_dtensor_comm::{Comm, LocalWorld, ReduceOp};
use candle_dtensor_mesh::{DeviceMesh, MeshError};

type R<T> = Result<T, Box<dyn Error + Send + Sync>>;

fn launch<T: Send>(n: usize, f: impl Fn(Comm) -> R<T> + Send + Sync) -> Vec<T> {
    LocalWorld::new(n)
        .with_timeout(Duration::from_secs(5))
        .with_bootstrap_timeout(Duration::from_secs(5))
        .launch(f)
        .unwrap_or_else(|e| panic!("{e}"))
}

/// Row-major coordinate, computed independently of the crate's layout module.
fn coord_of(rank: usize, shape: &[usize]) -> Vec<usize> {
    let strides: Vec<usize> = (0..shape.len())
        .map(|d| shape[d + 1..].iter().product())
        .collect();
    (0..shape.len())
        .map(|d| rank / strides[d] % shape[d])
        .collect()
}

/// The ranks sharing `me`'s coordinates outside `dims`, ordered row-major over `dims` (in the
/// order given): brute force over the whole world.
fn group_of(me: usize, shape: &[usize], dims: &[usize]) -> Vec<usize> {
    let world: usize = shape.iter().product();
    let mine = coord_of(me, shape);
    let mut g: Vec<(usize, usize)> = (0..world)
        .filter_map(|r| {
            let c = coord_of(r, shape);
            let same = (0..shape.len()).all(|d| dims.contains(&d) || c[d] == mine[d]);
            same.then(|| (dims.iter().fold(0, |acc, &d| acc * shape[d] + c[d]), r))
        })
        .collect();
    g.sort();
    g.into_iter().map(|(_, r)| r).collect()
}

/// Runs three collectives on `c` and checks them against the reference group `group`.
fn check_comm(c: &Comm, me: usize, group: &[usize], what: &str) -> R<()> {
    let n = group.len();
    assert_eq!(c.size(), n, "{what}: size");
    assert_eq!(
        group[c.rank()],
        me,
        "{what}: rank {} of {group:?}",
        c.rank()
    );
    let g = c
        .all_gather_single(&Tensor::new(&[me as u32], &Device::Cpu)?)?
        .wait()?
        .to_vec1::<u32>()?;
    let want: Vec<u32> = group.iter().map(|&r| r as u32).collect();
    assert_eq!(g, want, "{what}: all_gather");
    let s = c
        .all_reduce(
            &Tensor::new(&[me as i64 * 3 + 1], &Device::Cpu)?,
            ReduceOp::Sum,
        )?
        .wait()?
        .to_vec1::<i64>()?;
    let want: i64 = group.iter().map(|&r| r as i64 * 3 + 1).sum();
    assert_eq!(s, vec![want], "{what}: all_reduce");
    // Reduce-scatter of a per-rank row-block: chunk k sums the members' value k.
    let x: Vec<f32> = (0..n * 2).map(|i| (me * 10 + i) as f32).collect();
    let y = c
        .reduce_scatter_single(&Tensor::new(x.as_slice(), &Device::Cpu)?, ReduceOp::Sum)?
        .wait()?
        .to_vec1::<f32>()?;
    let k = c.rank();
    let want: Vec<f32> = (2 * k..2 * k + 2)
        .map(|i| group.iter().map(|&r| (r * 10 + i) as f32).sum())
        .collect();
    assert_eq!(y, want, "{what}: reduce_scatter");
    Ok(())
}

/// Builds a mesh of `dims` on a world of their product and checks every dim on every rank.
fn check_mesh(dims: &[(&str, usize)]) {
    let shape: Vec<usize> = dims.iter().map(|d| d.1).collect();
    let world: usize = shape.iter().product();
    launch(world, |root| {
        let me = root.rank();
        let mesh = DeviceMesh::new(root, dims)?;
        assert_eq!(mesh.ndim(), dims.len());
        assert_eq!(mesh.shape(), shape);
        assert_eq!(mesh.num_ranks(), world);
        assert_eq!(mesh.rank(), me);
        assert_eq!(
            mesh.coordinate().as_slice(),
            coord_of(me, &shape).as_slice()
        );
        assert_eq!(
            mesh.dim_names(),
            dims.iter().map(|d| d.0).collect::<Vec<_>>()
        );
        for (d, (name, size)) in dims.iter().enumerate() {
            assert_eq!(mesh.size(d)?, *size);
            assert_eq!(mesh.dim_index(name)?, d);
            let c = mesh.comm(d)?;
            assert_eq!(c.name(), *name);
            assert_eq!(c.rank(), mesh.coordinate()[d]);
            let what = format!("mesh {dims:?}, rank {me}, dim {name}");
            check_comm(c, me, &group_of(me, &shape, &[d]), &what)?;
        }
        // The root comm still works after all the splits.
        check_comm(
            mesh.root_comm(),
            me,
            &(0..world).collect::<Vec<_>>(),
            "root",
        )?;
        Ok(())
    });
}

#[test]
fn one_dimensional_meshes() {
    check_mesh(&[("dp", 4)]);
    check_mesh(&[("solo", 1)]);
}

#[test]
fn two_dimensional_meshes() {
    check_mesh(&[("dp", 2), ("tp", 4)]);
    check_mesh(&[("dp", 4), ("tp", 2)]);
    check_mesh(&[("replicate", 2), ("shard", 3)]);
    check_mesh(&[("dp", 1), ("tp", 3)]);
}

#[test]
fn three_dimensional_meshes() {
    check_mesh(&[("pp", 2), ("dp", 2), ("tp", 2)]);
    check_mesh(&[("pp", 2), ("dp", 3), ("tp", 2)]);
}

#[test]
fn four_dimensional_meshes() {
    check_mesh(&[("a", 2), ("b", 1), ("c", 2), ("d", 2)]);
    check_mesh(&[("a", 1), ("b", 2), ("c", 1), ("d", 3)]);
}

#[test]
fn slices_reuse_the_dim_comms() {
    launch(8, |root| {
        let me = root.rank();
        let mesh = DeviceMesh::new(root, &[("pp", 2), ("dp", 2), ("tp", 2)])?;
        let c = coord_of(me, &[2, 2, 2]);
        let s = mesh.slice(&["tp", "dp"])?;
        assert_eq!(s.shape(), vec![2, 2]);
        assert_eq!(s.dim_names(), vec!["tp", "dp"]);
        assert_eq!(s.coordinate().as_slice(), &[c[2], c[1]]);
        assert_eq!(s.comm(0)?.name(), "tp");
        assert!(s.same_mesh(&mesh.slice(&["tp", "dp"])?));
        assert!(!s.same_mesh(&mesh));
        assert_eq!(s.to_string(), "DeviceMesh(tp=2, dp=2)");
        // Reuse, not a new split: an op issued through the slice advances the mesh comm's seq.
        let tp = mesh.comm_by_name("tp")?;
        let before = tp.seq();
        s.comm(0)?.barrier()?.wait()?;
        mesh.dim("tp")?.comm(0)?.barrier()?.wait()?;
        assert_eq!(tp.seq(), before + 2);
        assert_eq!(mesh.dim("dp")?.shape(), vec![2]);
        Ok(())
    });
}

#[test]
fn flatten_creates_one_comm_per_dim_set() {
    let shape = [2usize, 2, 2];
    launch(8, |root| {
        let me = root.rank();
        let mesh = DeviceMesh::new(root, &[("pp", 2), ("dp", 2), ("tp", 2)])?;
        let flat = mesh.flatten(&["dp", "tp"], "dp_tp")?;
        assert_eq!((flat.ndim(), flat.shape()), (1, vec![4]));
        assert_eq!(flat.dim_names(), vec!["dp_tp"]);
        let group = group_of(me, &shape, &[1, 2]);
        assert_eq!(
            flat.coordinate()[0],
            group.iter().position(|&r| r == me).unwrap()
        );
        let fc = flat.comm(0)?;
        assert_eq!(fc.name(), "dp_tp");
        check_comm(fc, me, &group, "dp_tp")?;
        // Flattening the same dims again returns the same comm (no new split).
        let again = mesh.flatten(&["dp", "tp"], "dp_tp")?;
        let seq = fc.seq();
        again.comm(0)?.barrier()?.wait()?;
        assert_eq!(fc.seq(), seq + 1);
        assert_eq!(
            mesh.flattened_comm(&[1, 2]).map(|c| c.name().to_string()),
            Some("dp_tp".into())
        );
        assert_eq!(mesh.flattened_groups(), vec![vec![1, 2]]);
        assert!(mesh.flattened_comm(&[0, 1]).is_none());
        // Another order is another layout.
        let rev = mesh.flatten(&["tp", "dp"], "tp_dp")?;
        check_comm(rev.comm(0)?, me, &group_of(me, &shape, &[2, 1]), "tp_dp")?;
        // Non-adjacent dims and the whole mesh.
        let pt = mesh.flatten(&["pp", "tp"], "pp_tp")?;
        check_comm(pt.comm(0)?, me, &group_of(me, &shape, &[0, 2]), "pp_tp")?;
        let all = mesh.flatten(&["pp", "dp", "tp"], "all")?;
        check_comm(all.comm(0)?, me, &(0..8).collect::<Vec<_>>(), "all")?;
        Ok(())
    });
}

fn mesh_error(world: usize, dims: &'static [(&'static str, usize)]) -> Vec<MeshError> {
    launch(world, move |root| {
        Ok(DeviceMesh::new(root, dims).expect_err("a bad mesh"))
    })
}

#[test]
fn construction_errors_name_what_was_valid() {
    for e in mesh_error(4, &[("dp", 2), ("tp", 3)]) {
        assert!(
            matches!(
                e,
                MeshError::ShapeMismatch {
                    product: 6,
                    world: 4,
                    ..
                }
            ),
            "{e}"
        );
        let m = e.to_string();
        assert!(
            m.contains("(dp=2, tp=3)") && m.contains("is 6") && m.contains("\"world\" has 4 ranks"),
            "{m}"
        );
    }
    for e in mesh_error(4, &[("dp", 2), ("dp", 2)]) {
        assert!(matches!(&e, MeshError::DuplicateDim(n) if n == "dp"), "{e}");
        assert!(e.to_string().contains("\"dp\" appears twice"), "{e}");
    }
    for e in mesh_error(2, &[]) {
        assert!(matches!(e, MeshError::Invalid(_)), "{e}");
    }
    for e in mesh_error(2, &[("dp", 2), ("tp", 0)]) {
        assert!(e.to_string().contains("\"tp\" has size 0"), "{e}");
    }
    for e in mesh_error(2, &[("", 2)]) {
        assert!(e.to_string().contains("empty name"), "{e}");
    }
}

#[test]
fn lookup_errors_name_what_was_valid() {
    launch(4, |root| {
        let mesh = DeviceMesh::new(root, &[("dp", 2), ("tp", 2)])?;
        let e = mesh.comm_by_name("tpp").unwrap_err();
        assert!(
            matches!(&e, MeshError::UnknownDim { name, available } if name == "tpp" && available == &["dp", "tp"]),
            "{e}"
        );
        assert_eq!(
            e.to_string(),
            "unknown mesh dim \"tpp\"; mesh dims are [\"dp\", \"tp\"]"
        );
        let e = mesh.comm(2).unwrap_err();
        assert!(
            matches!(e, MeshError::DimOutOfRange { index: 2, ndim: 2 }),
            "{e}"
        );
        assert!(e.to_string().contains("2-d mesh"), "{e}");
        assert!(mesh.size(5).is_err());
        assert!(matches!(
            mesh.slice(&["dp", "dp"]),
            Err(MeshError::DuplicateDim(_))
        ));
        assert!(matches!(mesh.slice(&[]), Err(MeshError::Invalid(_))));
        assert!(matches!(mesh.dim("pp"), Err(MeshError::UnknownDim { .. })));
        // Flatten: unknown dims, repeats, and names that clash are caught before any split.
        assert!(matches!(
            mesh.flatten(&["dp", "xx"], "f"),
            Err(MeshError::UnknownDim { .. })
        ));
        assert!(matches!(
            mesh.flatten(&["tp", "tp"], "f"),
            Err(MeshError::DuplicateDim(_))
        ));
        let e = mesh.flatten(&["dp", "tp"], "tp").unwrap_err();
        assert!(e.to_string().contains("already a mesh dim"), "{e}");
        mesh.flatten(&["dp", "tp"], "flat")?;
        let e = mesh.flatten(&["tp", "dp"], "flat").unwrap_err();
        assert!(e.to_string().contains("already exists"), "{e}");
        // The mesh is still usable.
        mesh.comm_by_name("tp")?.barrier()?.wait()?;
        Ok(())
    });
}
