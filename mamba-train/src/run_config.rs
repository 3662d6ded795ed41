//! The identity of a training run: everything that decides its bits.

use mamba_reduce::ReduceContract;
use serde::{Deserialize, Serialize};

use crate::config::ModelConfig;
use crate::data::TaskSpec;
use crate::error::{Result, TrainError};
use crate::optim::{AdamWConfig, Schedule};

/// The reduction contracts a run may record (spelled by
/// [`ReduceContract::name`] in checkpoints and on the command line).
pub const CONTRACTS: [ReduceContract; 3] = [
    ReduceContract::FixedOrder,
    ReduceContract::NcclSum,
    ReduceContract::FixedTree,
];
/// The setting name of the architecture in comparisons.
const ARCH: &str = "arch";

/// The default contract: the fixed-order fold, whose bits do not depend on
/// the number of processes.
pub const DEFAULT_CONTRACT: ReduceContract = ReduceContract::FixedOrder;

/// Everything that decides a run's bits (besides the build and the
/// machine). Recorded in every checkpoint; a resume must match it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RunConfig {
    /// Master seed of the seed law (weights and data).
    pub seed: u64,
    /// Model shape.
    pub model: ModelConfig,
    /// Task and its shape.
    pub task: TaskSpec,
    /// Rows per logical micro-batch.
    pub batch: usize,
    /// Logical micro-batches per step (L); the gradient is their mean,
    /// folded in ascending order. 1 for a plain single-process run. Part of
    /// the run's identity: a different L is a different run.
    pub logical_world: usize,
    /// Reduction contract. Recorded (as its name) because under
    /// [`ReduceContract::NcclSum`] the bits may depend on the world a
    /// checkpoint was written in; a resume must keep it.
    #[serde(with = "contract_name")]
    pub contract: ReduceContract,
    /// AdamW hyper-parameters and clipping.
    pub optimizer: AdamWConfig,
    /// Learning-rate schedule (its `total_steps` is the run's length).
    pub schedule: Schedule,
}

impl RunConfig {
    /// Refuse a run that cannot work, naming the setting.
    pub fn validate(&self) -> Result<()> {
        self.model.validate()?;
        self.task.validate()?;
        self.optimizer.validate()?;
        self.schedule.validate()?;
        if self.batch == 0 {
            return Err(TrainError::setting(
                "batch",
                "must be at least 1 row, got 0",
            ));
        }
        if self.logical_world == 0 {
            return Err(TrainError::setting(
                "logical_world",
                "must be at least 1, got 0",
            ));
        }
        self.task.check_model_vocab(self.model.vocab_size)
    }

    /// Tokens consumed by one step (all logical micro-batches).
    pub fn tokens_per_step(&self) -> usize {
        self.batch * self.task.seq_len() * self.logical_world
    }

    /// Every setting (by its user-facing name) with its value, for
    /// comparisons. Text and token tasks contribute the data's identity
    /// (digests, fingerprints) and the tokenizer's SHA-256, not their
    /// paths: a moved file is the same data.
    fn fields(&self) -> Vec<(&'static str, String)> {
        let m = &self.model;
        let o = &self.optimizer;
        let s = &self.schedule;
        let mut v = vec![
            ("seed", self.seed.to_string()),
            ("task", self.task.kind().to_string()),
            ("seq_len", self.task.seq_len().to_string()),
        ];
        match &self.task {
            TaskSpec::SelectiveCopy(c) => {
                v.push(("n_memorize", c.n_memorize.to_string()));
                v.push(("alphabet", c.alphabet.to_string()));
            }
            TaskSpec::Induction(c) => v.push(("alphabet", c.alphabet.to_string())),
            TaskSpec::Text(c) => {
                v.push(("--data (sha256 of the corpus)", c.corpus_sha256.clone()));
                v.push(("val_fraction", c.val_fraction.to_string()));
            }
            TaskSpec::Tokens(c) => {
                let print = |f: &crate::data::token_file::FileFingerprint| {
                    format!("{} bytes, sampled sha256 {}", f.bytes, f.sampled_sha256)
                };
                v.push(("--data (train.bin)", print(&c.train)));
                v.push(("--data (val.bin)", print(&c.val)));
                v.push(("token_dtype", c.dtype.to_string()));
            }
        }
        if matches!(self.task, TaskSpec::Text(_) | TaskSpec::Tokens(_)) {
            let sha = self.task.tokenizer().map(|t| t.sha256.clone());
            v.push(("--tokenizer (sha256)", sha.unwrap_or_else(|| "none".into())));
        }
        v.extend([
            ("vocab_size", m.vocab_size.to_string()),
            ("d_model", m.d_model.to_string()),
            ("layers", m.n_layer.to_string()),
            ("d_state", m.d_state.to_string()),
            ("d_conv", m.d_conv.to_string()),
            ("expand", m.expand.to_string()),
            ("dt_rank", m.dt_rank.to_string()),
            ("batch", self.batch.to_string()),
            ("logical_world", self.logical_world.to_string()),
            ("contract", self.contract.name().to_string()),
            ("beta1", o.beta1.to_string()),
            ("beta2", o.beta2.to_string()),
            ("eps", o.eps.to_string()),
            ("weight_decay", o.weight_decay.to_string()),
            ("clip", o.clip_norm.to_string()),
            ("lr", s.peak_lr.to_string()),
            ("warmup", s.warmup_steps.to_string()),
            ("steps", s.total_steps.to_string()),
            ("min_lr_frac", s.min_lr_frac.to_string()),
        ]);
        // Mamba-2's fields only for Mamba-2, so that every Mamba-1 run keeps
        // the fingerprint it had before architectures existed.
        if let Some(ssd) = m.ssd() {
            v.extend([
                (ARCH, m.arch.name().to_string()),
                ("head_dim", ssd.head_dim.to_string()),
                ("n_groups", ssd.n_groups.to_string()),
                ("chunk_size", ssd.chunk_size.to_string()),
            ]);
        }
        v
    }

    /// A 64-bit fingerprint of every setting (as compared by
    /// [`RunConfig::mismatches`]), for the ranks' agreement check before
    /// the first reduction: ranks started with different settings fail
    /// with a clear error instead of training different models.
    pub fn fingerprint(&self) -> u64 {
        let text: Vec<String> = self
            .fields()
            .into_iter()
            .map(|(k, v)| format!("{k}={v}"))
            .collect();
        mamba_reduce::RunIdentity::fingerprint_of(text.join("\n").as_bytes())
    }

    /// Compare this (requested) run with the `recorded` one of a checkpoint.
    /// `Err` lists every differing setting as `name: checkpoint X, requested Y`.
    pub fn mismatches(&self, recorded: &RunConfig) -> std::result::Result<(), String> {
        let mine = self.fields();
        let theirs = recorded.fields();
        let mut diffs = Vec::new();
        for (name, want) in &mine {
            match theirs.iter().find(|(n, _)| n == name) {
                Some((_, got)) if got == want => {}
                Some((_, got)) => diffs.push(format!("{name}: checkpoint {got}, requested {want}")),
                None => diffs.push(format!("{name}: not in the checkpoint, requested {want}")),
            }
        }
        // A Mamba-1 request lists no `arch`; a Mamba-2 checkpoint does.
        if !mine.iter().any(|(n, _)| *n == ARCH) {
            if let Some((_, got)) = theirs.iter().find(|(n, _)| *n == ARCH) {
                diffs.push(format!(
                    "{ARCH}: checkpoint {got}, requested {}",
                    self.model.arch.name()
                ));
            }
        }
        if diffs.is_empty() {
            Ok(())
        } else {
            Err(format!(
                "the checkpoint was written by a different run ({}); resume with the checkpoint's settings (omit those flags)",
                diffs.join("; ")
            ))
        }
    }
}

/// A [`ReduceContract`] as its command-line name in JSON.
mod contract_name {
    use mamba_reduce::ReduceContract;
    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(c: &ReduceContract, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(c.name())
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<ReduceContract, D::Error> {
        let name = String::deserialize(d)?;
        name.parse().map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data::SelectiveCopyConfig;

    pub(crate) fn sample() -> RunConfig {
        let task = TaskSpec::SelectiveCopy(SelectiveCopyConfig {
            seq_len: 16,
            n_memorize: 4,
            alphabet: 6,
        });
        RunConfig {
            seed: 1,
            model: ModelConfig::new(task.vocab_size(), 16, 1),
            task,
            batch: 2,
            logical_world: 1,
            contract: DEFAULT_CONTRACT,
            optimizer: AdamWConfig::default(),
            schedule: Schedule {
                peak_lr: 1e-2,
                warmup_steps: 2,
                total_steps: 10,
                min_lr_frac: 0.1,
            },
        }
    }

    #[test]
    fn mismatches_name_every_differing_field() {
        let a = sample();
        assert!(a.mismatches(&a.clone()).is_ok());
        let mut b = a.clone();
        b.model = ModelConfig::new(a.model.vocab_size, 32, 1);
        b.schedule.peak_lr = 3e-3;
        let e = a.mismatches(&b).unwrap_err();
        assert!(e.contains("d_model: checkpoint 32, requested 16"), "{e}");
        assert!(e.contains("lr: checkpoint 0.003, requested 0.01"), "{e}");
        assert!(e.contains("dt_rank"), "dt_rank follows d_model: {e}");
        assert!(!e.contains("seed"), "{e}");
    }

    #[test]
    fn validate_catches_bad_runs() {
        let mut c = sample();
        c.model.vocab_size -= 1;
        assert!(c.validate().unwrap_err().to_string().contains("vocab_size"));
        // A pretrained model's larger vocabulary holds the task's tokens.
        let mut c = sample();
        c.model.vocab_size += 100;
        assert!(c.validate().is_ok());
        let mut c = sample();
        c.batch = 0;
        assert!(c.validate().unwrap_err().to_string().contains("batch"));
        assert!(sample().validate().is_ok());
        assert_eq!(sample().tokens_per_step(), 32);
    }

    #[test]
    fn the_contract_is_recorded_by_name_and_unknown_names_are_refused() {
        let mut c = sample();
        c.contract = ReduceContract::NcclSum;
        let json = serde_json::to_value(&c).unwrap();
        assert_eq!(json["contract"], "nccl-sum");
        let back: RunConfig = serde_json::from_value(json.clone()).unwrap();
        assert_eq!(back, c);
        let mut bad = json;
        bad["contract"] = "fastest".into();
        let e = serde_json::from_value::<RunConfig>(bad)
            .unwrap_err()
            .to_string();
        assert!(e.contains("fastest") && e.contains("fixed-order"), "{e}");
        let e = sample().mismatches(&c).unwrap_err();
        assert!(
            e.contains("contract: checkpoint nccl-sum, requested fixed-order"),
            "{e}"
        );
    }

    #[test]
    fn the_fingerprint_follows_every_setting() {
        let a = sample();
        assert_eq!(a.fingerprint(), a.clone().fingerprint());
        let mut b = a.clone();
        b.logical_world = 2;
        assert_ne!(a.fingerprint(), b.fingerprint());
        let mut c = a.clone();
        c.schedule.peak_lr = 2e-2;
        assert_ne!(a.fingerprint(), c.fingerprint());
    }

    #[test]
    fn the_architecture_joins_the_identity_only_for_mamba2() {
        let a = sample();
        let mut m2 = a.clone();
        m2.model = ModelConfig::mamba2(a.model.vocab_size, 16, 1);
        m2.model.d_state = a.model.d_state;
        assert_ne!(a.fingerprint(), m2.fingerprint());
        let e = a.mismatches(&m2).unwrap_err();
        assert!(
            e.contains("arch: checkpoint mamba2, requested mamba1"),
            "{e}"
        );
        let e = m2.mismatches(&a).unwrap_err();
        assert!(
            e.contains("arch: not in the checkpoint, requested mamba2"),
            "{e}"
        );
        let mut q = m2.clone();
        if let crate::config::Arch::Mamba2(s) = &mut q.model.arch {
            s.chunk_size = 7;
        }
        assert_ne!(
            q.fingerprint(),
            m2.fingerprint(),
            "the chunking decides bits"
        );
        assert!(q.mismatches(&m2).unwrap_err().contains("chunk_size"));
    }
}
