//! Text generation: the decoding state machine ([`engine`]), generic over
//! the device's [`Decoder`](crate::model::Decoder) (CPU or CUDA), how each
//! token is chosen ([`sample`]), and the text codec ([`text`]).

pub mod engine;
pub mod sample;
pub mod text;

#[cfg(test)]
mod sample_tests;

pub use engine::{generate, GenerateOptions, Generation, Phase, Stop};
pub use sample::{argmax, Candidate, Sampling};
