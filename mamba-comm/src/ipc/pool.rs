//! The IPC-capable memory pool, its export and import, and imported
//! pointers (driver API through cudarc's `sys`).

use std::collections::HashMap;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::{Arc, Mutex};

use cudarc::driver::sys::{
    self, CUdevice, CUdeviceptr, CUmemAccess_flags, CUmemAllocationHandleType, CUmemAllocationType,
    CUmemLocationType, CUmemPoolProps, CUmemPoolPtrExportData, CUmemoryPool, CUresult,
};
use cudarc::driver::CudaContext;

use crate::{CommError, Result};

/// One CUDA driver call's result as this crate's error.
fn check(op: &str, r: CUresult) -> Result<()> {
    if r == CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(CommError::transport(
            format!("sharing device memory ({op})"),
            format!("the CUDA driver returned {r:?}"),
        ))
    }
}

fn bind(ctx: &CudaContext) -> Result<()> {
    ctx.bind_to_thread().map_err(|e| {
        CommError::transport("sharing device memory (binding the context)", e.to_string())
    })
}

/// `cuDeviceGet` of a context's ordinal.
fn device_of(ctx: &CudaContext) -> Result<CUdevice> {
    let mut dev: CUdevice = 0;
    // SAFETY: writes one CUdevice.
    check("cuDeviceGet", unsafe {
        sys::cuDeviceGet(&mut dev, ctx.ordinal() as i32)
    })?;
    Ok(dev)
}

/// The exportable pool of one device, installed as its current pool.
///
/// Invariant: `pool` is a live pool created with POSIX fd handles on
/// `ordinal`, never destroyed (it lives in a process-wide table), and it is
/// the device's current pool from [`SharedPool::install`] on, unless
/// something else calls `cuDeviceSetMemPool` later (then new allocations
/// are not exportable and [`SharedPool::export_pointer`] says so).
#[derive(Debug)]
pub struct SharedPool {
    ordinal: usize,
    pool: CUmemoryPool,
}

// SAFETY: a CUmemoryPool is a driver handle usable from any thread; the
// pool is never destroyed, so sharing the handle cannot dangle.
unsafe impl Send for SharedPool {}
// SAFETY: as above; every use goes through thread-safe driver calls.
unsafe impl Sync for SharedPool {}

fn installed() -> &'static Mutex<HashMap<usize, Arc<SharedPool>>> {
    static POOLS: std::sync::OnceLock<Mutex<HashMap<usize, Arc<SharedPool>>>> =
        std::sync::OnceLock::new();
    POOLS.get_or_init(|| Mutex::new(HashMap::new()))
}

impl SharedPool {
    /// The exportable pool of `ctx`'s device, created and made the device's
    /// current pool at the first call (later calls return the same pool).
    /// Memory the process allocated on the device before the first call
    /// stays in the previous pool and cannot be shared: install before
    /// allocating what peers must read.
    pub fn install(ctx: &Arc<CudaContext>) -> Result<Arc<SharedPool>> {
        let mut table = installed()
            .lock()
            .map_err(|_| CommError::config("the shared-pool table was poisoned by a panic"))?;
        if let Some(p) = table.get(&ctx.ordinal()) {
            return Ok(p.clone());
        }
        bind(ctx)?;
        let dev = device_of(ctx)?;
        let mut supported = 0i32;
        // SAFETY: writes one int.
        check("cuDeviceGetAttribute", unsafe {
            sys::cuDeviceGetAttribute(
                &mut supported,
                sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MEMPOOL_SUPPORTED_HANDLE_TYPES,
                dev,
            )
        })?;
        let fd_type = CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
        if supported as u32 & fd_type.0 == 0 {
            return Err(CommError::config(format!(
                "CUDA device {} cannot share pool memory through file descriptors (supported \
                 handle types {supported:#x}); peer access needs a Linux driver with memory-pool \
                 IPC",
                ctx.ordinal()
            )));
        }
        // SAFETY: all-zero is a valid CUmemPoolProps (plain integers and a
        // null pointer); the fields that matter are set below.
        let mut props: CUmemPoolProps = unsafe { std::mem::zeroed() };
        props.allocType = CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
        props.handleTypes = fd_type;
        props.location.type_ = CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
        props.location.id = ctx.ordinal() as i32;
        let mut pool: CUmemoryPool = std::ptr::null_mut();
        // SAFETY: props is initialised; writes one pool handle.
        check("cuMemPoolCreate", unsafe {
            sys::cuMemPoolCreate(&mut pool, &props)
        })?;
        // SAFETY: dev and pool are live; the pool is never destroyed.
        check("cuDeviceSetMemPool", unsafe {
            sys::cuDeviceSetMemPool(dev, pool)
        })?;
        let shared = Arc::new(SharedPool {
            ordinal: ctx.ordinal(),
            pool,
        });
        table.insert(ctx.ordinal(), shared.clone());
        Ok(shared)
    }

    /// The device ordinal.
    pub fn ordinal(&self) -> usize {
        self.ordinal
    }

    /// A file descriptor for the pool, for a peer's [`ImportedPool::import`]
    /// (send it with `FdListener::serve`).
    pub fn export_fd(&self) -> Result<OwnedFd> {
        let mut fd: i32 = -1;
        // SAFETY: for POSIX fd handles the driver writes an int.
        check("cuMemPoolExportToShareableHandle", unsafe {
            sys::cuMemPoolExportToShareableHandle(
                (&mut fd as *mut i32).cast(),
                self.pool,
                CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
                0,
            )
        })?;
        if fd < 0 {
            return Err(CommError::transport(
                "sharing device memory (cuMemPoolExportToShareableHandle)",
                format!("the driver returned the invalid descriptor {fd}"),
            ));
        }
        // SAFETY: the driver just created fd for us; nothing else owns it.
        Ok(unsafe { OwnedFd::from_raw_fd(fd) })
    }

    /// Export data for the allocation that starts at `ptr` (in `ctx`, this
    /// pool's device), of which peers will use `bytes`. Refused, with the
    /// reason, when the allocation is not from this pool (allocated before
    /// [`SharedPool::install`], or by `cuMemAlloc`); the driver refuses an
    /// address inside an allocation, and any pointer until the pool itself
    /// has been exported once ([`SharedPool::export_fd`]), with
    /// `CUDA_ERROR_INVALID_VALUE`.
    pub fn export_pointer(
        &self,
        ctx: &CudaContext,
        ptr: CUdeviceptr,
        bytes: u64,
    ) -> Result<ExportedPointer> {
        bind(ctx)?;
        let mut owner: CUmemoryPool = std::ptr::null_mut();
        // SAFETY: the attribute is a CUmemoryPool handle (null when the
        // allocation is not from a pool).
        check("cuPointerGetAttribute", unsafe {
            sys::cuPointerGetAttribute(
                (&mut owner as *mut CUmemoryPool).cast(),
                sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_MEMPOOL_HANDLE,
                ptr,
            )
        })?;
        if owner != self.pool {
            return Err(CommError::config(format!(
                "device memory at {ptr:#x} was not allocated from the shared pool of device {}; \
                 install it (SharedPool::install) before allocating memory peers must read",
                self.ordinal
            )));
        }
        // SAFETY: all-zero bytes are valid export data to overwrite.
        let mut data: CUmemPoolPtrExportData = unsafe { std::mem::zeroed() };
        // SAFETY: ptr is a live allocation of this pool (the driver checks
        // that it is an allocation's start).
        check("cuMemPoolExportPointer", unsafe {
            sys::cuMemPoolExportPointer(&mut data, ptr)
        })?;
        Ok(ExportedPointer {
            data: data.reserved,
            bytes,
        })
    }
}

/// What a peer needs to map one allocation of a [`SharedPool`]: the
/// driver's 64 bytes and the bytes the exporter lets peers use. Plain
/// bytes: any channel carries it ([`ExportedPointer::to_bytes`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ExportedPointer {
    data: [u8; 64],
    bytes: u64,
}

impl ExportedPointer {
    /// Encoded length of [`ExportedPointer::to_bytes`].
    pub const BYTES: usize = 72;

    /// The encoding: the data, then the size as a little-endian u64.
    pub fn to_bytes(&self) -> [u8; Self::BYTES] {
        let mut out = [0u8; Self::BYTES];
        out[..64].copy_from_slice(&self.data);
        out[64..].copy_from_slice(&self.bytes.to_le_bytes());
        out
    }

    /// Decode [`ExportedPointer::to_bytes`]; `None` for another length.
    pub fn from_bytes(b: &[u8]) -> Option<ExportedPointer> {
        if b.len() != Self::BYTES {
            return None;
        }
        let mut data = [0u8; 64];
        data.copy_from_slice(&b[..64]);
        let mut size = [0u8; 8];
        size.copy_from_slice(&b[64..]);
        Some(ExportedPointer {
            data,
            bytes: u64::from_le_bytes(size),
        })
    }

    /// The bytes peers may use.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }
}

/// A peer's [`SharedPool`], imported into this process's context.
///
/// Invariant: `pool` is a live imported pool with read-write access
/// granted to `ctx`'s device; destroyed on drop, after every
/// [`ImportedPointer`] of it (each holds an `Arc` of it).
#[derive(Debug)]
pub struct ImportedPool {
    ctx: Arc<CudaContext>,
    pool: CUmemoryPool,
}

// SAFETY: the handle is used only through thread-safe driver calls, with
// the context bound first.
unsafe impl Send for ImportedPool {}
// SAFETY: as above.
unsafe impl Sync for ImportedPool {}

impl ImportedPool {
    /// Import the pool behind `fd` (from a peer's [`SharedPool::export_fd`])
    /// into `ctx` and let `ctx`'s device read and write it.
    pub fn import(ctx: &Arc<CudaContext>, fd: OwnedFd) -> Result<Arc<ImportedPool>> {
        bind(ctx)?;
        let mut pool: CUmemoryPool = std::ptr::null_mut();
        // SAFETY: for POSIX fd handles the handle argument is the fd value
        // itself; the driver does not take ownership (fd closes on drop).
        check("cuMemPoolImportFromShareableHandle", unsafe {
            sys::cuMemPoolImportFromShareableHandle(
                &mut pool,
                fd.as_raw_fd() as usize as *mut std::ffi::c_void,
                CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
                0,
            )
        })?;
        let imported = Arc::new(ImportedPool {
            ctx: ctx.clone(),
            pool,
        });
        // SAFETY: all-zero is a valid access descriptor to fill in.
        let mut access: sys::CUmemAccessDesc = unsafe { std::mem::zeroed() };
        access.location.type_ = CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
        access.location.id = ctx.ordinal() as i32;
        access.flags = CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
        // SAFETY: one initialised descriptor for a live pool.
        check("cuMemPoolSetAccess", unsafe {
            sys::cuMemPoolSetAccess(imported.pool, &access, 1)
        })?;
        Ok(imported)
    }

    /// Map the allocation `exported` describes (one of this pool's).
    pub fn import_pointer(self: &Arc<Self>, exported: &ExportedPointer) -> Result<ImportedPointer> {
        bind(&self.ctx)?;
        let mut data = CUmemPoolPtrExportData {
            reserved: exported.data,
        };
        let mut base: CUdeviceptr = 0;
        // SAFETY: data is the exporter's 64 bytes for this pool; writes one
        // device pointer.
        check("cuMemPoolImportPointer", unsafe {
            sys::cuMemPoolImportPointer(&mut base, self.pool, &mut data)
        })?;
        Ok(ImportedPointer {
            pool: self.clone(),
            base,
            bytes: exported.bytes,
        })
    }
}

impl Drop for ImportedPool {
    fn drop(&mut self) {
        // Errors cannot be reported from drop; a failed destroy leaks the
        // import until the process ends.
        if self.ctx.bind_to_thread().is_ok() {
            // SAFETY: every pointer of the pool was freed (they hold Arcs).
            let _ = unsafe { sys::cuMemPoolDestroy(self.pool) };
        }
    }
}

/// A peer's allocation mapped into this process: [`ImportedPointer::address`]
/// is valid device memory of this context while the value lives.
#[derive(Debug)]
pub struct ImportedPointer {
    pool: Arc<ImportedPool>,
    base: CUdeviceptr,
    bytes: u64,
}

impl ImportedPointer {
    /// The exported allocation, as seen from this context.
    pub fn address(&self) -> CUdeviceptr {
        self.base
    }

    /// The bytes the exporter lets peers use from [`ImportedPointer::address`].
    pub fn len_bytes(&self) -> u64 {
        self.bytes
    }

    /// Copy `bytes` from the host to `address() + offset`, synchronously
    /// (ordered after nothing in particular: for flags the peer polls, such
    /// as an abort). Refused past the allocation's end.
    pub fn write(&self, offset: u64, bytes: &[u8]) -> Result<()> {
        let end = offset.checked_add(bytes.len() as u64);
        if end.is_none_or(|e| e > self.len_bytes()) {
            return Err(CommError::config(format!(
                "writing {} bytes at offset {offset} of a shared allocation of {} bytes",
                bytes.len(),
                self.len_bytes()
            )));
        }
        bind(&self.pool.ctx)?;
        // SAFETY: the destination range lies inside the mapped allocation
        // (checked above), which lives as long as self; the source is a live
        // host slice.
        check("cuMemcpyHtoD", unsafe {
            sys::cuMemcpyHtoD_v2(self.address() + offset, bytes.as_ptr().cast(), bytes.len())
        })
    }
}

impl Drop for ImportedPointer {
    fn drop(&mut self) {
        if self.pool.ctx.bind_to_thread().is_ok() {
            // SAFETY: base came from cuMemPoolImportPointer and is freed once;
            // cuMemFree waits for work using it.
            let _ = unsafe { sys::cuMemFree_v2(self.base) };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::ExportedPointer;

    #[test]
    fn exported_pointers_round_trip_through_bytes() {
        let mut data = [0u8; 64];
        for (i, b) in data.iter_mut().enumerate() {
            *b = (i * 37 % 251) as u8;
        }
        let e = ExportedPointer {
            data,
            bytes: 0x0123_4567_89ab_cdef,
        };
        let b = e.to_bytes();
        assert_eq!(ExportedPointer::from_bytes(&b), Some(e));
        assert_eq!(
            ExportedPointer::from_bytes(&b).unwrap().bytes(),
            0x0123_4567_89ab_cdef
        );
        assert_eq!(ExportedPointer::from_bytes(&b[1..]), None);
    }
}
