// kernels/attention.cu built for the CPU with the emulator (emu.h), and one entry point that
// launches any of its kernels by name as cuLaunchKernel does: the kernel's arguments given as
// an array of pointers, one to each. tests/train/test_attention_emulated.py builds this with
//   c++ -std=c++17 -shared -fPIC -I<the kernels directory> <the loader's -D options> launch.cpp
// and calls emu_launch through ctypes.
#include <cstring>
#include <functional>
#include <utility>

#include "emu.h"
// emu.h first: it defines FLASH_EMULATE and what the kernel file then leaves out
#include "attention.cu"

namespace {

// A kernel called with params[i] pointing at its i-th argument.
template <class... Args, size_t... I>
void call(void (*kernel)(Args...), void** params, std::index_sequence<I...>) {
    kernel(*static_cast<Args*>(params[I])...);
}

struct Kernel {
    const char* name;
    std::function<void(void**)> run;
};

template <class... Args>
Kernel kernel(const char* name, void (*k)(Args...)) {
    return {name, [k](void** params) { call(k, params, std::index_sequence_for<Args...>{}); }};
}

#define KERNEL(name) kernel(#name, name)
const Kernel kKernels[] = {
    KERNEL(flash_forward_d64),  KERNEL(flash_dq_d64),  KERNEL(flash_dkdv_d64),
    KERNEL(flash_forward_d128), KERNEL(flash_dq_d128), KERNEL(flash_dkdv_d128),
    KERNEL(flash_delta),
};

}  // namespace

// Launches kernel `name` on grid[0..2] blocks of block[0..2] threads with `shared` bytes of
// dynamic shared memory; cp.async may read only inside the n_arrays arrays (arrays[i],
// sizes[i] bytes). Returns nullptr, or what went wrong.
extern "C" const char* emu_launch(const char* name, const unsigned* grid, const unsigned* block,
                                  size_t shared, void** params, const void* const* arrays,
                                  const size_t* sizes, int n_arrays, unsigned long long seed) {
    for (const Kernel& k : kKernels) {
        if (std::strcmp(k.name, name) != 0) continue;
        std::vector<std::pair<uintptr_t, size_t>> readable;
        for (int i = 0; i < n_arrays; ++i)
            readable.emplace_back(reinterpret_cast<uintptr_t>(arrays[i]), sizes[i]);
        return emu::launch({grid[0], grid[1], grid[2]}, {block[0], block[1], block[2]}, shared,
                           std::move(readable), seed, [&] { k.run(params); });
    }
    return "no kernel of that name";
}
