/* Reciprocal throughput of the AVX-512 instructions the C update kernel's time goes to
 * (qstate/optim/csrc/update_kernel.c): the rule's square root and divisions, the 8-bit codecs'
 * permutes, shifts and compares into masks, the rounding hash's multiplies, and the ALU and FMA work
 * around them. Eight (four where written by hand) independent instructions per loop iteration,
 * nanoseconds per instruction; a dependent scalar add gives the clock (one cycle).
 *
 *     cc -O2 -march=native benchmarks/bench_cpu_ops.c -o /tmp/bench_cpu_ops && /tmp/bench_cpu_ops
 *
 * Needs AVX-512 (VBMI for vpermi2b). Figures: benchmarks/RESULTS.md. */
#include <stdio.h>
#include <time.h>

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

#define N 20000000L
#define REPORT(name, t0, count) printf("%-22s %.3f ns\n", name, (now() - (t0)) / N / (count) * 1e9)
/* eight independent three-operand zmm instructions (zmm0, zmm1 are never written) */
#define BENCH8(name, ins)                                                                            \
    {                                                                                                \
        const double t0 = now();                                                                     \
        for (long i = 0; i < N; i++)                                                                 \
            __asm__ volatile(ins " %%zmm0,%%zmm1,%%zmm10\n" ins " %%zmm0,%%zmm1,%%zmm11\n"           \
                             ins " %%zmm0,%%zmm1,%%zmm12\n" ins " %%zmm0,%%zmm1,%%zmm13\n"           \
                             ins " %%zmm0,%%zmm1,%%zmm14\n" ins " %%zmm0,%%zmm1,%%zmm15\n"           \
                             ins " %%zmm0,%%zmm1,%%zmm16\n" ins " %%zmm0,%%zmm1,%%zmm17\n" ::         \
                                 : "xmm10", "xmm11", "xmm12", "xmm13", "xmm14", "xmm15", "xmm16", "xmm17"); \
        REPORT(name, t0, 8);                                                                         \
    }

int main(void) {
    __asm__ volatile("vpternlogd $0xff,%%zmm0,%%zmm0,%%zmm0\n vpxord %%zmm1,%%zmm1,%%zmm1" ::: "xmm0", "xmm1");
    {
        const double t0 = now();
        for (long i = 0; i < N; i++)
            __asm__ volatile("add $1,%%rax\n add $1,%%rax\n add $1,%%rax\n add $1,%%rax\n"
                             "add $1,%%rax\n add $1,%%rax\n add $1,%%rax\n add $1,%%rax" ::: "rax");
        REPORT("dependent add (clock)", t0, 8);
    }
    BENCH8("vpaddd zmm", "vpaddd")
    BENCH8("vpsrlvw zmm", "vpsrlvw")
    BENCH8("vpblendmb zmm", "vpblendmb")
    BENCH8("vmulps zmm", "vmulps")
    BENCH8("vfmadd231ps zmm", "vfmadd231ps")
    BENCH8("vpermb zmm", "vpermb")
    BENCH8("vpermi2b zmm", "vpermi2b")
    BENCH8("vpermi2w zmm", "vpermi2w")
    BENCH8("vpermps zmm", "vpermps")
    BENCH8("vdivps zmm", "vdivps")
  BENCH8("vpmulld zmm", "vpmulld")
  BENCH8("vpmuludq zmm", "vpmuludq")
    {
        const double t0 = now();
        for (long i = 0; i < N; i++)
            __asm__ volatile("vpsrld $3,%%zmm0,%%zmm10\n vpsrld $3,%%zmm0,%%zmm11\n"
                             "vpsrld $3,%%zmm0,%%zmm12\n vpsrld $3,%%zmm0,%%zmm13" ::: "xmm10", "xmm11", "xmm12", "xmm13");
        REPORT("vpsrld imm zmm", t0, 4);
    }
    {
        const double t0 = now();
        for (long i = 0; i < N; i++)
            __asm__ volatile("vcmpps $1,%%zmm0,%%zmm1,%%k2\n vcmpps $1,%%zmm0,%%zmm1,%%k3\n"
                             "vcmpps $1,%%zmm0,%%zmm1,%%k4\n vcmpps $1,%%zmm0,%%zmm1,%%k5" ::: "k2", "k3", "k4", "k5");
        REPORT("vcmpps zmm -> mask", t0, 4);
    }
    {
        const double t0 = now();
        for (long i = 0; i < N; i++)
            __asm__ volatile("vsqrtps %%zmm0,%%zmm10\n vsqrtps %%zmm0,%%zmm11\n"
                             "vsqrtps %%zmm0,%%zmm12\n vsqrtps %%zmm0,%%zmm13" ::: "xmm10", "xmm11", "xmm12", "xmm13");
        REPORT("vsqrtps zmm", t0, 4);
    }
    return 0;
}
