//! The self-spawn supervisor: with no launcher, a program re-executes itself
//! once per rank with the project contract (`MAMBA_*`) in the environment,
//! watches the children, and at the first failure kills (SIGKILL) and reaps
//! the whole world. Children die with the supervisor (`PR_SET_PDEATHSIG`
//! on Linux). Every rank's exit is reported.
//!
//! Entry points: [`start_world`] (programs: join or launch), [`spawn_world`]
//! / [`Supervisor`] (explicit control), [`test_world()`] (real-process worlds
//! in `cargo test`).

mod behind;
mod options;
mod report;
mod spawn;
mod start;
mod test_world;

pub use behind::{behind, Behind, RankFlight};
pub use options::SpawnOptions;
pub use report::{RankExit, RankStatus, WorldReport};
pub use spawn::{spawn_world, Supervisor};
pub use start::{start_world, Role};
pub use test_world::{test_spawn, test_world, test_world_with, TEST_WORLD_DEADLINE};
