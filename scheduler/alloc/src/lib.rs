//! The allocator of rota's binaries: mimalloc, called as its fast path
//! expects.
//!
//! The `mimalloc` crate passes every request through `mi_malloc_aligned`,
//! alignment included. In mimalloc 3 that call takes the plain fast path
//! only while a small page of the right size has a free block that happens
//! to be aligned; otherwise (a page just used up, or a request over 1 KiB)
//! it falls back to a generic path that, unless the size class is a power
//! of two, allocates `size + align - 1` bytes and aligns inside the block.
//! Such a block lands in a larger size class and marks its page as holding
//! interior pointers, which slows every later free on that page. A replica
//! spent about 4-5 % of its samples in that fallback at 256 clients.
//!
//! On 64-bit targets mimalloc rounds every size class above 8 bytes to a
//! multiple of 16 and starts every page's blocks 16-aligned, so a plain
//! `mi_malloc` already meets any layout whose alignment is at most 16 and
//! at most its size (the rule of the standard library's own `System`
//! allocator). Those requests go to `mi_malloc`, `mi_zalloc` and
//! `mi_realloc`; larger alignments keep the aligned calls. `mi_free` takes
//! either kind of block.

use std::alloc::{GlobalAlloc, Layout};
use std::ffi::c_void;

use libmimalloc_sys as mi;

/// The largest alignment that every block of a plain `mi_malloc` of at
/// least that many bytes has.
const PLAIN_ALIGN: usize = 16;

/// mimalloc as the global allocator:
/// `#[global_allocator] static ALLOCATOR: rota_alloc::Allocator = rota_alloc::Allocator;`
pub struct Allocator;

/// Whether a block of `size` bytes from a plain call is aligned to `align`.
fn plain_fits(size: usize, align: usize) -> bool {
    align <= PLAIN_ALIGN && align <= size
}

// SAFETY: every block comes from mimalloc and goes back to it; the plain
// calls are used only where their blocks meet the layout's alignment (see
// the module's text, and the test that checks it over every size class).
unsafe impl GlobalAlloc for Allocator {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        if plain_fits(layout.size(), layout.align()) {
            mi::mi_malloc(layout.size()).cast()
        } else {
            mi::mi_malloc_aligned(layout.size(), layout.align()).cast()
        }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        if plain_fits(layout.size(), layout.align()) {
            mi::mi_zalloc(layout.size()).cast()
        } else {
            mi::mi_zalloc_aligned(layout.size(), layout.align()).cast()
        }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, _layout: Layout) {
        mi::mi_free(ptr.cast::<c_void>());
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        if plain_fits(new_size, layout.align()) {
            mi::mi_realloc(ptr.cast::<c_void>(), new_size).cast()
        } else {
            mi::mi_realloc_aligned(ptr.cast::<c_void>(), new_size, layout.align()).cast()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every size from 1 byte to 64 KiB in every size class's steps (and a
    /// few huge ones), each alignment up to 4 KiB that the size allows:
    /// the block is aligned, writable to its end, and reallocation keeps
    /// both its alignment and its bytes.
    #[test]
    fn every_block_meets_its_layout() {
        let allocator = Allocator;
        let mut sizes: Vec<usize> = (1..=1024).collect();
        sizes.extend((1025..=65_536).step_by(8));
        sizes.extend([1 << 20, (1 << 20) + 8, 5 << 20, (32 << 20) + 16]);
        for &size in &sizes {
            for align in (0..=12).map(|shift| 1usize << shift) {
                if size % align != 0 {
                    continue; // no Rust type has such a layout
                }
                let layout = Layout::from_size_align(size, align).expect("a valid layout");
                // SAFETY: non-zero size; each block is freed with its own layout.
                unsafe {
                    // Many at once, so that pages fill up and the allocator
                    // leaves its per-page fast path as it does under load.
                    let blocks: Vec<*mut u8> = (0..if size <= 4096 { 64 } else { 2 }).map(|_| allocator.alloc(layout)).collect();
                    for &block in &blocks {
                        assert!(!block.is_null(), "{size} bytes");
                        assert_eq!(block as usize % align, 0, "{size} bytes aligned to {align}");
                        block.write_bytes(0xA5, size);
                    }
                    let zeroed = allocator.alloc_zeroed(layout);
                    assert_eq!(zeroed as usize % align, 0, "zeroed {size} bytes aligned to {align}");
                    assert!(std::slice::from_raw_parts(zeroed, size).iter().all(|&b| b == 0));
                    allocator.dealloc(zeroed, layout);
                    let grown_layout = Layout::from_size_align(size * 3, align).expect("a valid layout");
                    let grown = allocator.realloc(blocks[0], layout, grown_layout.size());
                    assert_eq!(grown as usize % align, 0, "{size} bytes grown, aligned to {align}");
                    assert!(std::slice::from_raw_parts(grown, size).iter().all(|&b| b == 0xA5), "kept on growth");
                    allocator.dealloc(grown, grown_layout);
                    for &block in &blocks[1..] {
                        allocator.dealloc(block, layout);
                    }
                }
            }
        }
    }

    #[test]
    fn the_plain_path_is_taken_only_where_its_blocks_suffice() {
        assert!(plain_fits(8, 8));
        assert!(plain_fits(24, 8));
        assert!(plain_fits(48, 16));
        assert!(plain_fits(4096, 16));
        assert!(!plain_fits(64, 32), "over 16 bytes of alignment takes the aligned call");
        assert!(!plain_fits(4, 8), "smaller than its alignment takes the aligned call");
    }
}
