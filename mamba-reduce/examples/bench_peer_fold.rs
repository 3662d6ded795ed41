//! Benchmark: what one GPU can show of the peer fold ([`PeerReducer`]).
//!
//! ```text
//! bench_peer_fold [--sizes-mib 1,4,64,256,1024] [--logical 2,4] [--reps N]
//! ```
//!
//! One process (`P = 1`), so no link is involved: the fused kernel folds the
//! `L` local arenas of each size into arena 0 between the two barriers, and
//! every timed call is a whole `reduce_mean` (barrier, fold, barrier, one
//! host wait, the status read). Columns: `ms` = median over `--reps`;
//! `GB/s` = the fold's HBM bytes (`(L + 1) N x 4`: every addend read once,
//! the mean written once) over that time; `/ copy` = that rate against the
//! device-to-device copy bandwidth measured first in the same run (read +
//! write of 1 GiB). A one-element row gives the fixed cost of a reduction
//! (two barrier launches, an empty fold, the wait and the status read): the
//! host cost of a peer-fold window, against ~70-120 us per nonblocking NCCL
//! group measured on 2 x H200 (docs/PERFORMANCE.md).

use std::sync::Arc;
use std::time::{Duration, Instant};

use cudarc::driver::{CudaSlice, CudaStream};
use mamba_comm::host::{HostOptions, HostTransport};
use mamba_reduce::{
    HostReducer, PeerOptions, PeerReducer, ReduceContract, Reducer, ReducerOptions,
};

struct Args {
    sizes_mib: Vec<f64>,
    logical: Vec<usize>,
    reps: usize,
}

fn parse() -> Result<Args, String> {
    let mut a = Args {
        sizes_mib: vec![1.0, 4.0, 64.0, 256.0, 1024.0],
        logical: vec![2, 4],
        reps: 20,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = || it.next().ok_or_else(|| format!("{flag} needs a value"));
        match flag.as_str() {
            "--sizes-mib" => {
                a.sizes_mib = list(&flag, &value()?)?;
            }
            "--logical" => a.logical = list(&flag, &value()?)?,
            "--reps" => {
                a.reps = value()?
                    .parse()
                    .map_err(|e| format!("--reps: {e}; expected a count"))?
            }
            "--bench" => {}
            other => {
                return Err(format!(
                    "unknown flag {other}; expected --sizes-mib LIST, --logical LIST or --reps N"
                ))
            }
        }
    }
    if a.reps == 0 || a.logical.contains(&0) || a.sizes_mib.iter().any(|&s| s <= 0.0) {
        return Err("--reps, every --logical and every size must be positive".into());
    }
    Ok(a)
}

fn list<T: std::str::FromStr>(flag: &str, v: &str) -> Result<Vec<T>, String>
where
    T::Err: std::fmt::Display,
{
    v.split(',')
        .map(|s| s.trim().parse().map_err(|e| format!("{flag}: {s:?}: {e}")))
        .collect()
}

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

fn copy_bandwidth(s: &Arc<CudaStream>) -> Result<f64, String> {
    let n = 256 << 20; // 1 GiB of f32
    let src = s.alloc_zeros::<f32>(n).map_err(|e| e.to_string())?;
    let mut dst = s.alloc_zeros::<f32>(n).map_err(|e| e.to_string())?;
    let mut times = Vec::new();
    for _ in 0..6 {
        s.synchronize().map_err(|e| e.to_string())?;
        let t = Instant::now();
        s.memcpy_dtod(&src, &mut dst).map_err(|e| e.to_string())?;
        s.synchronize().map_err(|e| e.to_string())?;
        times.push(t.elapsed());
    }
    Ok(2.0 * (n * 4) as f64 / median(times[1..].to_vec()).as_secs_f64() / 1e9)
}

fn run() -> Result<(), String> {
    let a = parse()?;
    let ctx = kernels::open_context(0).map_err(|e| e.to_string())?;
    let s = ctx.new_stream().map_err(|e| e.to_string())?;
    let copy = copy_bandwidth(&s)?;
    println!(
        "device 0; copy bandwidth {copy:.0} GB/s (read+write of 1024 MiB); median of {} reps",
        a.reps
    );
    println!("| L | MiB | ms | GB/s | / copy |");
    println!("|---:|---:|---:|---:|---:|");
    for &logical in &a.logical {
        let mut sizes: Vec<usize> = vec![1];
        sizes.extend(a.sizes_mib.iter().map(|m| ((m * 1048576.0) / 4.0) as usize));
        for len in sizes {
            let t =
                HostTransport::thread_world(1, HostOptions::with_timeout(Duration::from_secs(60)))
                    .map_err(|e| e.to_string())?
                    .remove(0);
            let control =
                HostReducer::new(t, ReducerOptions::new(ReduceContract::FixedOrder, logical));
            let mut r = PeerReducer::new(control, s.clone(), PeerOptions::default())
                .map_err(|e| e.to_string())?;
            let mut local: Vec<CudaSlice<f32>> = (0..logical)
                .map(|_| s.alloc_zeros::<f32>(len).map_err(|e| e.to_string()))
                .collect::<Result<_, _>>()?;
            r.reduce_mean(&mut local).map_err(|e| e.to_string())?;
            let mut times = Vec::with_capacity(a.reps);
            for _ in 0..a.reps {
                let t = Instant::now();
                r.reduce_mean(&mut local).map_err(|e| e.to_string())?;
                times.push(t.elapsed());
            }
            let m = median(times);
            let bytes = ((logical + 1) * len * 4) as f64;
            let rate = bytes / m.as_secs_f64() / 1e9;
            let mib = (len * 4) as f64 / 1048576.0;
            if len == 1 {
                println!(
                    "| {logical} | 1 element | {:.3} | — | fixed cost {:.1} us |",
                    m.as_secs_f64() * 1e3,
                    m.as_secs_f64() * 1e6
                );
            } else {
                println!(
                    "| {logical} | {mib:.0} | {:.3} | {rate:.0} | {:.2} |",
                    m.as_secs_f64() * 1e3,
                    rate / copy
                );
            }
        }
    }
    Ok(())
}

fn main() -> std::process::ExitCode {
    match run() {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("bench_peer_fold: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}
