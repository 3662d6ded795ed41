//! The environment contract, over generated environments (no process
//! environment is read or written).

use std::collections::BTreeMap;
use std::path::PathBuf;

use mamba_comm::bootstrap::{detect, vars::*, Launcher, WorldPlace};
use mamba_comm::CommError;
use proptest::prelude::*;

type Env = BTreeMap<String, String>;

fn env(pairs: &[(&str, String)]) -> Env {
    pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.clone()))
        .collect()
}

const FAMILIES: [(Launcher, &str, &str, &str); 4] = [
    (
        Launcher::Mamba,
        MAMBA_RANK,
        MAMBA_WORLD_SIZE,
        MAMBA_LOCAL_RANK,
    ),
    (Launcher::Torchrun, RANK, WORLD_SIZE, LOCAL_RANK),
    (
        Launcher::OpenMpi,
        OMPI_COMM_WORLD_RANK,
        OMPI_COMM_WORLD_SIZE,
        OMPI_COMM_WORLD_LOCAL_RANK,
    ),
    (Launcher::Slurm, SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID),
];

const ALL_VARS: &[&str] = &[
    MAMBA_RANK,
    MAMBA_WORLD_SIZE,
    MAMBA_LOCAL_RANK,
    MAMBA_RENDEZVOUS_DIR,
    MAMBA_JOB_ID,
    MAMBA_LAUNCH_ID,
    MAMBA_SEED,
    MAMBA_LOGICAL_WORLD,
    MAMBA_STORE_PORT,
    RANK,
    WORLD_SIZE,
    LOCAL_RANK,
    MASTER_ADDR,
    MASTER_PORT,
    TORCHELASTIC_RUN_ID,
    TORCHELASTIC_USE_AGENT_STORE,
    SLURM_PROCID,
    SLURM_NTASKS,
    SLURM_LOCALID,
    SLURM_JOB_ID,
    SLURM_STEP_ID,
    OMPI_COMM_WORLD_RANK,
    OMPI_COMM_WORLD_SIZE,
    OMPI_COMM_WORLD_LOCAL_RANK,
    OMPI_MCA_ESS_BASE_JOBID,
    PMIX_NAMESPACE,
];

/// A well-formed world under one launcher.
#[derive(Clone, Debug)]
struct Valid {
    family: usize,
    world: usize,
    rank: usize,
    local: Option<usize>,
    job: String,
    seed: Option<u64>,
    logical_mult: Option<usize>,
    tcp: bool,
}

fn valid() -> impl Strategy<Value = Valid> {
    (0usize..4, 1usize..65)
        .prop_flat_map(|(family, world)| {
            (
                Just(family),
                Just(world),
                0..world,
                proptest::option::of(0..world),
                "[a-z0-9][a-z0-9_.-]{0,20}",
                proptest::option::of(any::<u64>()),
                proptest::option::of(1usize..5),
                any::<bool>(),
            )
        })
        .prop_filter("no '..' in ids", |t| !t.4.contains(".."))
        .prop_map(
            |(family, world, rank, local, job, seed, logical_mult, tcp)| Valid {
                family,
                world,
                rank,
                local,
                job,
                seed,
                logical_mult,
                tcp,
            },
        )
}

fn build(v: &Valid) -> Env {
    let (_, rv, wv, lv) = FAMILIES[v.family];
    let mut e = env(&[(rv, v.rank.to_string()), (wv, v.world.to_string())]);
    if let Some(l) = v.local {
        e.insert(lv.into(), l.to_string());
    }
    e.insert(MAMBA_JOB_ID.into(), v.job.clone());
    if let Some(s) = v.seed {
        e.insert(MAMBA_SEED.into(), s.to_string());
    }
    if let Some(m) = v.logical_mult {
        e.insert(MAMBA_LOGICAL_WORLD.into(), (m * v.world).to_string());
    }
    if v.tcp {
        e.insert(MASTER_ADDR.into(), "10.0.0.1".into());
        e.insert(MASTER_PORT.into(), "29500".into());
    } else {
        e.insert(MAMBA_RENDEZVOUS_DIR.into(), "/shared/rdv".into());
    }
    e
}

/// Arbitrary assignments to every contract variable: absent, empty, a
/// small number, a large number, or garbage.
fn chaos() -> impl Strategy<Value = Env> {
    let value = prop_oneof![
        3 => Just(None),
        1 => Just(Some(String::new())),
        3 => (0usize..6).prop_map(|n| Some(n.to_string())),
        1 => Just(Some("99999999999999999999999".to_string())),
        1 => Just(Some("-1".to_string())),
        1 => Just(Some("x/..".to_string())),
        1 => Just(Some("/abs/dir".to_string())),
    ];
    proptest::collection::vec(value, ALL_VARS.len()).prop_map(|vals| {
        ALL_VARS
            .iter()
            .zip(vals)
            .filter_map(|(k, v)| v.map(|v| (k.to_string(), v)))
            .collect()
    })
}

fn err_var(r: &Result<Option<WorldPlace>, CommError>) -> Option<String> {
    match r {
        Err(CommError::EnvContract { var, .. }) => Some(var.clone()),
        _ => None,
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn a_valid_world_is_read_back_exactly(v in valid()) {
        let e = build(&v);
        let place = detect(&e).expect("valid env").expect("a launcher is present");
        prop_assert_eq!(place.launcher, FAMILIES[v.family].0);
        prop_assert_eq!(place.rank, v.rank);
        prop_assert_eq!(place.world, v.world);
        prop_assert_eq!(place.local_rank, v.local.unwrap_or(v.rank));
        prop_assert_eq!(place.device(), place.local_rank);
        prop_assert_eq!(&place.job_id, &v.job);
        prop_assert_eq!(place.seed, v.seed);
        prop_assert_eq!(place.logical_world, v.logical_mult.map(|m| m * v.world));
        if v.tcp {
            prop_assert_eq!(place.master, Some(("10.0.0.1".to_string(), 29500)));
            prop_assert_eq!(place.rendezvous_dir, None);
        } else {
            prop_assert_eq!(place.rendezvous_dir, Some(PathBuf::from("/shared/rdv")));
        }
    }

    #[test]
    fn the_contract_env_round_trips(v in valid()) {
        let place = detect(&build(&v)).expect("valid").expect("present");
        let back = detect(&place.contract_env().into_iter().collect::<Env>()).expect("valid").expect("present");
        let mut want = place.clone();
        want.launcher = Launcher::Mamba;
        prop_assert_eq!(back, want);
    }

    #[test]
    fn empty_values_are_exactly_unset(e in chaos()) {
        let without: Env = e.iter().filter(|(_, v)| !v.is_empty()).map(|(k, v)| (k.clone(), v.clone())).collect();
        let (a, b) = (detect(&e), detect(&without));
        match (&a, &b) {
            (Ok(x), Ok(y)) => prop_assert_eq!(x, y),
            _ => prop_assert_eq!(err_var(&a), err_var(&b), "{:?} vs {:?}", a, b),
        }
    }

    #[test]
    fn every_error_is_an_env_contract_error_naming_known_variables(e in chaos()) {
        match detect(&e) {
            Ok(Some(p)) => {
                prop_assert!(p.rank < p.world && p.local_rank < p.world);
                if let Some(l) = p.logical_world { prop_assert_eq!(l % p.world, 0); }
            }
            Ok(None) => {}
            Err(CommError::EnvContract { var, detail }) => {
                for part in var.split('/') {
                    prop_assert!(ALL_VARS.contains(&part), "unknown variable {part} in {var}: {detail}");
                }
                prop_assert!(!detail.is_empty());
            }
            Err(other) => prop_assert!(false, "not an EnvContract error: {other:?}"),
        }
    }

    #[test]
    fn garbage_in_the_active_rank_or_world_is_named(v in valid(), bad in "[a-z+ -]{1,5}|99999999999999999999999", world_side in any::<bool>()) {
        let (_, rv, wv, _) = FAMILIES[v.family];
        let mut e = build(&v);
        let target = if world_side { wv } else { rv };
        e.insert(target.into(), bad);
        prop_assert_eq!(err_var(&detect(&e)), Some(target.to_string()));
    }

    #[test]
    fn rank_at_or_past_the_world_is_named(v in valid(), extra in 0usize..3) {
        let (_, rv, _, _) = FAMILIES[v.family];
        let mut e = build(&v);
        e.insert(rv.into(), (v.world + extra).to_string());
        prop_assert_eq!(err_var(&detect(&e)), Some(rv.to_string()));
    }

    #[test]
    fn a_rank_without_a_world_is_named(v in valid()) {
        let (_, rv, wv, _) = FAMILIES[v.family];
        let mut e = build(&v);
        e.remove(wv);
        // SLURM: the rank alone is an error; the other families too.
        prop_assert_eq!(err_var(&detect(&e)), Some(wv.to_string()));
        let mut e = build(&v);
        e.remove(rv);
        let r = detect(&e);
        if FAMILIES[v.family].0 == Launcher::Slurm {
            // SLURM_NTASKS alone is an allocation shell, not a task.
            prop_assert!(matches!(r, Ok(None)), "{:?}", r);
        } else {
            prop_assert_eq!(err_var(&r), Some(rv.to_string()));
        }
    }

    #[test]
    fn a_physical_world_that_does_not_divide_the_logical_world_is_named(v in valid(), l in 1usize..200) {
        prop_assume!(l % v.world != 0);
        let (_, _, wv, _) = FAMILIES[v.family];
        let mut e = build(&v);
        e.insert(MAMBA_LOGICAL_WORLD.into(), l.to_string());
        prop_assert_eq!(err_var(&detect(&e)), Some(format!("{wv}/{MAMBA_LOGICAL_WORLD}")));
        let place = detect(&build(&v)).expect("valid").expect("present");
        prop_assert!(place.check_logical_world(l).is_err());
        prop_assert!(place.check_logical_world(v.world * 3).is_ok());
    }

    #[test]
    fn the_most_specific_launcher_wins(vs in proptest::collection::vec(valid(), 2..5)) {
        // The winner brings the shared settings; the others only their own
        // rank/world/local-rank variables (as a nested launcher leaves them).
        let best = vs.iter().map(|v| v.family).min().expect("non-empty");
        let winner = vs.iter().find(|v| v.family == best).expect("present");
        let mut e = build(winner);
        // A lesser contract that cannot be an outer launcher of the winner
        // (torchrun or Open MPI beside the project's own) describes the same
        // process and so carries the same rank and world; SLURM without a
        // step id (a batch script) and Open MPI/SLURM beside torchrun are
        // outer launchers and may hold anything.
        for v in vs.iter().filter(|v| v.family != best) {
            let (_, rv, wv, lv) = FAMILIES[v.family];
            let same_process = best == 0 && (v.family == 1 || v.family == 2);
            let (rank, world) = if same_process { (winner.rank, winner.world) } else { (v.rank, v.world) };
            e.insert(rv.into(), rank.to_string());
            e.insert(wv.into(), world.to_string());
            if let Some(l) = v.local { e.insert(lv.into(), l.to_string()); }
        }
        let p = detect(&e).expect("valid").expect("present");
        prop_assert_eq!(p.launcher, FAMILIES[best].0);
        prop_assert_eq!((p.rank, p.world), (winner.rank, winner.world));
        prop_assert_eq!(p.local_rank, winner.local.unwrap_or(winner.rank));
    }
}

#[test]
fn no_launcher_means_none_but_overrides_are_still_checked() {
    assert_eq!(detect(&Env::new()).expect("empty env"), None);
    assert_eq!(
        detect(&env(&[
            (SLURM_NTASKS, "8".into()),
            (SLURM_JOB_ID, "5".into())
        ]))
        .expect("salloc"),
        None
    );
    assert_eq!(
        err_var(&detect(&env(&[(MAMBA_SEED, "12x".into())]))),
        Some(MAMBA_SEED.into())
    );
    assert_eq!(
        err_var(&detect(&env(&[(
            MAMBA_RENDEZVOUS_DIR,
            "relative/dir".into()
        )]))),
        Some(MAMBA_RENDEZVOUS_DIR.into())
    );
    assert_eq!(
        err_var(&detect(&env(&[(MAMBA_JOB_ID, "../up".into())]))),
        Some(MAMBA_JOB_ID.into())
    );
}

#[test]
fn half_set_overrides_are_named() {
    for var in [MAMBA_LOCAL_RANK, MAMBA_LAUNCH_ID] {
        let e = env(&[
            (var, "1".into()),
            (RANK, "0".into()),
            (WORLD_SIZE, "2".into()),
        ]);
        assert_eq!(err_var(&detect(&e)), Some(var.to_string()));
    }
    let e = env(&[
        (RANK, "0".into()),
        (WORLD_SIZE, "2".into()),
        (MASTER_ADDR, "h".into()),
    ]);
    assert_eq!(err_var(&detect(&e)), Some(MASTER_PORT.into()));
    let e = env(&[
        (RANK, "0".into()),
        (WORLD_SIZE, "2".into()),
        (MASTER_PORT, "1".into()),
    ]);
    assert_eq!(err_var(&detect(&e)), Some(MASTER_ADDR.into()));
    let e = env(&[
        (RANK, "0".into()),
        (WORLD_SIZE, "2".into()),
        (MAMBA_STORE_PORT, "1".into()),
    ]);
    assert_eq!(err_var(&detect(&e)), Some(MASTER_ADDR.into()));
}

#[test]
fn multi_rank_worlds_meeting_through_a_directory_need_a_job_id() {
    // SLURM without a job id and no MASTER_*: directory rendezvous, no id.
    let e = env(&[(SLURM_PROCID, "0".into()), (SLURM_NTASKS, "2".into())]);
    assert_eq!(err_var(&detect(&e)), Some(MAMBA_JOB_ID.into()));
    // A world of one needs none.
    let e = env(&[(SLURM_PROCID, "0".into()), (SLURM_NTASKS, "1".into())]);
    assert!(detect(&e).expect("solo").is_some());
    // Over TCP the store's lifetime scopes the launch: no id needed.
    let e = env(&[
        (RANK, "1".into()),
        (WORLD_SIZE, "2".into()),
        (MASTER_ADDR, "127.0.0.1".into()),
        (MASTER_PORT, "29500".into()),
    ]);
    let p = detect(&e).expect("tcp").expect("present");
    assert_eq!(p.rendezvous_dir, None);
    assert_eq!(p.master, Some(("127.0.0.1".into(), 29500)));
}

#[test]
fn launcher_job_ids_are_derived_and_validated() {
    let e = env(&[
        (SLURM_PROCID, "1".into()),
        (SLURM_NTASKS, "4".into()),
        (SLURM_LOCALID, "1".into()),
        (SLURM_JOB_ID, "812".into()),
        (SLURM_STEP_ID, "3".into()),
    ]);
    let p = detect(&e).expect("slurm").expect("present");
    assert_eq!(
        (p.job_id.as_str(), p.launcher, p.launch_id.clone()),
        ("slurm-812.3", Launcher::Slurm, None)
    );
    assert!(p.rendezvous_dir.is_some(), "single-host default directory");
    let e = env(&[
        (RANK, "0".into()),
        (WORLD_SIZE, "2".into()),
        (TORCHELASTIC_RUN_ID, "a/b".into()),
        (MAMBA_RENDEZVOUS_DIR, "/r".into()),
    ]);
    assert_eq!(err_var(&detect(&e)), Some(TORCHELASTIC_RUN_ID.into()));
    let e = env(&[
        (OMPI_COMM_WORLD_RANK, "0".into()),
        (OMPI_COMM_WORLD_SIZE, "2".into()),
        (PMIX_NAMESPACE, "prterun-host-1234@1".into()),
    ]);
    assert_eq!(
        detect(&e).expect("ompi").expect("present").job_id,
        "ompi-prterun-host-1234@1"
    );
    // MAMBA_JOB_ID overrides the launcher's.
    let e = env(&[
        (OMPI_COMM_WORLD_RANK, "0".into()),
        (OMPI_COMM_WORLD_SIZE, "2".into()),
        (MAMBA_JOB_ID, "mine".into()),
    ]);
    assert_eq!(detect(&e).expect("ompi").expect("present").job_id, "mine");
}

#[test]
fn torchrun_agent_store_moves_our_store_one_port_up() {
    let base = [
        (RANK, "0".to_string()),
        (WORLD_SIZE, "2".to_string()),
        (MASTER_ADDR, "node0".to_string()),
        (MASTER_PORT, "29500".to_string()),
        (TORCHELASTIC_USE_AGENT_STORE, "True".to_string()),
    ];
    let p = detect(&env(&base)).expect("torchrun").expect("present");
    assert_eq!(p.master, Some(("node0".into(), 29501)));
    let mut with = base.to_vec();
    with.push((MAMBA_STORE_PORT, "40000".into()));
    assert_eq!(
        detect(&env(&with)).expect("ok").expect("present").master,
        Some(("node0".into(), 40000))
    );
    let mut top = base.to_vec();
    top[3].1 = "65535".into();
    assert_eq!(err_var(&detect(&env(&top))), Some(MASTER_PORT.into()));
}

fn err_of(r: &Result<Option<WorldPlace>, CommError>) -> (String, String) {
    match r {
        Err(CommError::EnvContract { var, detail }) => (var.clone(), detail.clone()),
        other => panic!("expected an EnvContract error, got {other:?}"),
    }
}

#[test]
fn torchrun_without_master_addr_is_an_error_not_a_node_local_directory() {
    let base = vec![
        (RANK, "1".to_string()),
        (WORLD_SIZE, "4".to_string()),
        (LOCAL_RANK, "1".to_string()),
        (TORCHELASTIC_RUN_ID, "job7".to_string()),
    ];
    let (var, detail) = err_of(&detect(&env(&base)));
    assert_eq!(var, format!("{MASTER_ADDR}/{MASTER_PORT}"));
    assert!(detail.contains(MAMBA_RENDEZVOUS_DIR), "{detail}");
    // The documented shared-filesystem way keeps working.
    let mut shared = base.clone();
    shared.push((MAMBA_RENDEZVOUS_DIR, "/shared/rdv".into()));
    let p = detect(&env(&shared)).expect("shared dir").expect("present");
    assert_eq!(p.rendezvous_dir, Some(PathBuf::from("/shared/rdv")));
    assert_eq!(p.job_id, "torchrun-job7");
    // A torchrun world of one needs no rendezvous at all.
    let solo = env(&[(RANK, "0".into()), (WORLD_SIZE, "1".into())]);
    assert!(detect(&solo).expect("solo").is_some());
}

#[test]
fn a_stray_project_rank_beside_torchrun_is_named_with_both_values() {
    let e = env(&[
        (MAMBA_RANK, "1".into()),
        (MAMBA_WORLD_SIZE, "2".into()),
        (RANK, "0".into()),
        (WORLD_SIZE, "2".into()),
        (MASTER_ADDR, "h".into()),
        (MASTER_PORT, "1".into()),
    ]);
    let (var, detail) = err_of(&detect(&e));
    assert_eq!(var, format!("{MAMBA_RANK}/{RANK}"));
    assert!(
        detail.contains("MAMBA_RANK=1") && detail.contains("RANK=0"),
        "{detail}"
    );
    // A world-size contradiction names the world variables.
    let e = env(&[
        (MAMBA_RANK, "0".into()),
        (MAMBA_WORLD_SIZE, "2".into()),
        (OMPI_COMM_WORLD_RANK, "0".into()),
        (OMPI_COMM_WORLD_SIZE, "4".into()),
        (MAMBA_JOB_ID, "j".into()),
    ]);
    let (var, detail) = err_of(&detect(&e));
    assert_eq!(var, format!("{MAMBA_WORLD_SIZE}/{OMPI_COMM_WORLD_SIZE}"));
    assert!(
        detail.contains("MAMBA_WORLD_SIZE=2") && detail.contains("OMPI_COMM_WORLD_SIZE=4"),
        "{detail}"
    );
    // Agreeing values are fine: the project contract describes the same
    // torchrun worker.
    let e = env(&[
        (MAMBA_RANK, "1".into()),
        (MAMBA_WORLD_SIZE, "2".into()),
        (RANK, "1".into()),
        (WORLD_SIZE, "2".into()),
        (MASTER_ADDR, "h".into()),
        (MASTER_PORT, "1".into()),
    ]);
    assert_eq!(
        detect(&e).expect("agree").expect("present").launcher,
        Launcher::Mamba
    );
}

#[test]
fn open_mpi_and_a_slurm_step_of_the_same_processes_must_agree() {
    // srun started these very processes (a step with as many tasks as
    // Open MPI's world) and they contradict: an error naming both.
    let e = env(&[
        (OMPI_COMM_WORLD_RANK, "1".into()),
        (OMPI_COMM_WORLD_SIZE, "4".into()),
        (SLURM_PROCID, "0".into()),
        (SLURM_NTASKS, "4".into()),
        (SLURM_STEP_ID, "0".into()),
        (SLURM_JOB_ID, "9".into()),
        (MAMBA_JOB_ID, "j".into()),
    ]);
    let (var, detail) = err_of(&detect(&e));
    assert_eq!(var, format!("{OMPI_COMM_WORLD_RANK}/{SLURM_PROCID}"));
    assert!(
        detail.contains("OMPI_COMM_WORLD_RANK=1") && detail.contains("SLURM_PROCID=0"),
        "{detail}"
    );
    // The same values agreeing: fine, Open MPI wins.
    let mut agree = e.clone();
    agree.insert(SLURM_PROCID.into(), "1".into());
    assert_eq!(
        detect(&agree).expect("agree").expect("present").launcher,
        Launcher::OpenMpi
    );
}

#[test]
fn a_leaked_outer_launcher_is_told_apart_and_ignored() {
    let check = |pairs: &[(&str, &str)], want: Launcher, rank: usize| {
        let e: Env = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        let p = detect(&e)
            .unwrap_or_else(|e| panic!("{pairs:?}: {e}"))
            .expect("present");
        assert_eq!((p.launcher, p.rank), (want, rank), "{pairs:?}");
    };
    // mpirun in a batch script: the batch step (no SLURM_STEP_ID) leaks.
    check(
        &[
            (OMPI_COMM_WORLD_RANK, "3"),
            (OMPI_COMM_WORLD_SIZE, "8"),
            (MAMBA_JOB_ID, "j"),
            (SLURM_PROCID, "0"),
            (SLURM_NTASKS, "8"),
            (SLURM_JOB_ID, "9"),
        ],
        Launcher::OpenMpi,
        3,
    );
    // mpirun's daemons, one srun task per node, leak their step.
    check(
        &[
            (OMPI_COMM_WORLD_RANK, "3"),
            (OMPI_COMM_WORLD_SIZE, "8"),
            (MAMBA_JOB_ID, "j"),
            (SLURM_PROCID, "1"),
            (SLURM_NTASKS, "2"),
            (SLURM_STEP_ID, "0"),
            (SLURM_JOB_ID, "9"),
        ],
        Launcher::OpenMpi,
        3,
    );
    // torchrun under srun (any number of tasks per node): SLURM describes
    // the agents, never torchrun's workers.
    check(
        &[
            (RANK, "5"),
            (WORLD_SIZE, "8"),
            (MASTER_ADDR, "n0"),
            (MASTER_PORT, "29500"),
            (SLURM_PROCID, "2"),
            (SLURM_NTASKS, "8"),
            (SLURM_STEP_ID, "0"),
        ],
        Launcher::Torchrun,
        5,
    );
    // torchrun agents started by mpirun.
    check(
        &[
            (RANK, "5"),
            (WORLD_SIZE, "8"),
            (MASTER_ADDR, "n0"),
            (MASTER_PORT, "29500"),
            (OMPI_COMM_WORLD_RANK, "1"),
            (OMPI_COMM_WORLD_SIZE, "2"),
        ],
        Launcher::Torchrun,
        5,
    );
    // Our own supervisor run inside `srun -n 1` (e.g. cargo test).
    check(
        &[
            (MAMBA_RANK, "1"),
            (MAMBA_WORLD_SIZE, "2"),
            (MAMBA_JOB_ID, "j"),
            (SLURM_PROCID, "0"),
            (SLURM_NTASKS, "1"),
            (SLURM_STEP_ID, "0"),
        ],
        Launcher::Mamba,
        1,
    );
}
