/* AMX's tile configuration and Linux's grant of the tile state, for the kernels that run tiles
 * (kernels/cpu_int8_gemm.c: int8 tiles; kernels/cpu_decode_layers.c: the LoRA deltas' bfloat16 tiles). */
#ifndef CPU_AMX_H
#define CPU_AMX_H

#include <cpuid.h>
#include <stdint.h>
#include <sys/syscall.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18
#define AMX_BF16_BIT 22 /* CPUID.(7, 0):EDX bits */
#define AMX_TILE_BIT 24
#define AMX_INT8_BIT 25

/* The tile registers' shapes, as ldtilecfg reads them (palette 1; reserved bytes zero). */
struct tile_config {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};

/* Whether the CPU has AMX tiles with the CPUID.(7, 0):EDX feature `bit` and Linux grants this process the
 * tile state (asked here: without the grant the first tile instruction faults). */
static inline int amx_granted(int bit)
{
    unsigned eax, ebx, ecx, edx;
    int cpu = __get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx) && (edx >> AMX_TILE_BIT & 1) && (edx >> bit & 1);
    return cpu && syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
}

#endif
