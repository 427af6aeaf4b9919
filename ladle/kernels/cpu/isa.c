/* Which vector paths this build of the kernels has, in ladle.kernels.cpu_isa.CpuIsa's order: 0 scalar, 1 AVX2,
 * 2 AVX-512, 3 AVX-512 BF16. The loader checks it against the level it compiled for, so a compiler that ignored
 * a flag cannot leave a process on another path than its settings table says. */
#include "common.h"

int ladle_isa(void) { return LADLE_AVX512_BF16 ? 3 : LADLE_AVX512 ? 2 : LADLE_AVX2 ? 1 : 0; }
