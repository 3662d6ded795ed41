//! Where a kernel writes an activation it produces: its f32 values, their
//! bf16 rounding, or both ([`Store`]); and how a kernel reads one that is
//! kept in either type ([`Stored`]: a bf16 run keeps some activations in
//! bf16 alone, SPEC's "bf16 is the type of ... stored activations").
//!
//! A bf16 GEMM reads a bf16 copy of its operands. Casting an f32 activation
//! afterwards ([`MambaKernels::cast_bf16`](super::MambaKernels::cast_bf16))
//! reads it back from memory once more; a kernel that stores the copy itself
//! saves that pass. Both round with the same device function (`bf16_rne` in
//! `mamba_common.cuh`, the host twin [`f32_to_bf16_rne`](super::f32_to_bf16_rne)),
//! so a fused store and a cast afterwards give the same bits.

use cudarc::driver::{CudaView, CudaViewMut};

use super::check;
use super::launcher::Arg;
use crate::error::KernelError;

/// The buffers one activation is written to. Each has the activation's
/// shape and leading dimension; a kernel given one of them leaves the other
/// untouched (it is passed as a null pointer).
pub enum Store<'b> {
    /// f32 values only.
    F32(CudaViewMut<'b, f32>),
    /// Their bf16 rounding only (an activation only bf16 GEMMs read).
    Bf16(CudaViewMut<'b, u16>),
    /// Both.
    Both(CudaViewMut<'b, f32>, CudaViewMut<'b, u16>),
}

impl<'b> Store<'b> {
    /// f32 values, plus their bf16 copy when `bf16` is given.
    pub fn f32_and(f32s: CudaViewMut<'b, f32>, bf16: Option<CudaViewMut<'b, u16>>) -> Self {
        match bf16 {
            Some(h) => Store::Both(f32s, h),
            None => Store::F32(f32s),
        }
    }

    /// Whether the f32 values are written.
    pub fn has_f32(&self) -> bool {
        !matches!(self, Store::Bf16(_))
    }

    /// Check every given buffer with `check` (its name in errors, its
    /// length): `name` for the f32 values, `name` + `"_bf16"` for the copy.
    pub(crate) fn check_each(
        &self,
        name: &str,
        check: impl Fn(&str, usize) -> Result<(), KernelError>,
    ) -> Result<(), KernelError> {
        if let Store::F32(f) | Store::Both(f, _) = self {
            check(name, f.len())?;
        }
        if let Store::Bf16(h) | Store::Both(_, h) = self {
            check(&format!("{name}_bf16"), h.len())?;
        }
        Ok(())
    }

    /// [`Self::check_each`] against a `[rows, width]` matrix of leading
    /// dimension `ld`.
    pub(crate) fn check_matrix(
        &self,
        kernel: &'static str,
        name: &str,
        rows: usize,
        width: usize,
        ld: usize,
    ) -> Result<(), KernelError> {
        self.check_each(name, |what, have| {
            check::matrix(kernel, what, have, rows, width, ld)
        })
    }

    /// The kernel's two pointer arguments, in the order `float* f32s,
    /// unsigned short* bf16` (null for the one not given).
    pub(crate) fn args<'s>(&'s mut self) -> [Arg<'s>; 2] {
        match self {
            Store::F32(f) => [Arg::Out(f), Arg::Null],
            Store::Bf16(h) => [Arg::Null, Arg::Out(h)],
            Store::Both(f, h) => [Arg::Out(f), Arg::Out(h)],
        }
    }
}

/// An activation a kernel reads, as it is kept: f32, or bf16 alone (read
/// widened to f32, which is exact). The kernel takes the pair of pointers
/// `const float* f, const unsigned short* h`, exactly one of them not null.
#[derive(Clone, Copy)]
pub enum Stored<'a> {
    F32(&'a CudaView<'a, f32>),
    Bf16(&'a CudaView<'a, u16>),
}

impl<'a> Stored<'a> {
    /// Elements.
    pub fn len(&self) -> usize {
        match self {
            Stored::F32(v) => v.len(),
            Stored::Bf16(v) => v.len(),
        }
    }

    /// Whether it holds no element.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Whether it is kept in bf16.
    pub fn is_bf16(&self) -> bool {
        matches!(self, Stored::Bf16(_))
    }

    /// The one pointer argument of a kernel that takes the activation as
    /// it is kept (`const float*` or `const unsigned short*`, chosen by the
    /// kernel it is launched with: the caller picks the kernel by
    /// [`Self::is_bf16`]).
    pub(crate) fn kept_arg(&self) -> Arg<'a> {
        match *self {
            Stored::F32(f) => Arg::In(f),
            Stored::Bf16(h) => Arg::In(h),
        }
    }

    /// The kernel's two pointer arguments, `const float* f, const unsigned
    /// short* h` (null for the type not given).
    pub(crate) fn args(&self) -> [Arg<'a>; 2] {
        match *self {
            Stored::F32(f) => [Arg::In(f), Arg::Null],
            Stored::Bf16(h) => [Arg::Null, Arg::In(h)],
        }
    }
}

impl<'a> From<&'a CudaView<'a, f32>> for Stored<'a> {
    fn from(v: &'a CudaView<'a, f32>) -> Self {
        Stored::F32(v)
    }
}

impl<'a> From<&'a CudaView<'a, u16>> for Stored<'a> {
    fn from(v: &'a CudaView<'a, u16>) -> Self {
        Stored::Bf16(v)
    }
}
