/* Replays shim.c's log through this process's glibc (never touching the pages) and prints, per marked
   step, the heap arena + mapped bytes at their peak, the live bytes then, and the fresh pages (arena
   and mapped growth) of the step; only blocks of MIN_BYTES and more with a second argument.
   GLIBC_TUNABLES applies as in any process. Section 20 of docs/benchmarks-history.md. */
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <stdint.h>
#include <malloc.h>
#include <sys/mman.h>
typedef struct { uint64_t op, a, b, c; } ev_t;
#define HS (1UL << 24)
static uint64_t *keys, *vals;
static uint64_t *slot(uint64_t k) { uint64_t h = (k * 0x9E3779B97F4A7C15ULL) >> 40; while (keys[h] && keys[h] != k) h = (h + 1) & (HS - 1); return &keys[h]; }
static void put(uint64_t k, uint64_t v) { uint64_t *s = slot(k); *s = k; vals[s - keys] = v; }
static uint64_t take(uint64_t k) { uint64_t *s = slot(k); if (!*s) return 0; uint64_t v = vals[s - keys];
  /* delete with backward shift */ uint64_t i = s - keys; keys[i] = 0; uint64_t j = i;
  for (;;) { j = (j + 1) & (HS - 1); if (!keys[j]) break; uint64_t h = (keys[j] * 0x9E3779B97F4A7C15ULL) >> 40;
    if ((j > i && (h <= i || h > j)) || (j < i && (h <= i && h > j))) { keys[i] = keys[j]; vals[i] = vals[j]; keys[j] = 0; i = j; } }
  return v; }
int main(int argc, char **argv) {
  uint64_t minsize = argc > 2 ? strtoull(argv[2], 0, 0) : 0;  /* replay only blocks >= minsize */
  keys = mmap(0, HS * 8, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  vals = mmap(0, HS * 8, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  FILE *f = fopen(argv[1], "rb"); ev_t e; double G = 1 << 30; size_t peak = 0, live_at = 0, fresh = 0, last_h = 0, last_a = 0; int step = 0;
  while (fread(&e, sizeof e, 1, f) == 1) {
    void *p = 0; uint64_t size = 0, old = 0;
    switch (e.op) {
      case 9: if (step) printf("step %d: held %.3f live %.3f fresh %.2f\n", step, peak / G, live_at / G, fresh / G);
              step = e.a; peak = 0; fresh = 0; continue;
      case 1: size = e.a; if (size >= minsize) { p = malloc(size); put(e.b, (uint64_t)p); } break;
      case 5: size = e.a; if (size >= minsize) { p = calloc(1, size); put(e.b, (uint64_t)p); } break;
      case 4: size = e.b; if (size >= minsize) { posix_memalign(&p, e.a, size); put(e.c, (uint64_t)p); } break;
      case 2: old = take(e.a); if (old) { size_t u = malloc_usable_size((void *)old); free((void *)old); if (u >= 65536) { struct mallinfo2 m = mallinfo2(); last_h = m.hblkhd; last_a = m.arena; } } continue;
      case 3: old = take(e.a); size = e.b;
              if (old || (e.a == 0 && size >= minsize)) { p = realloc((void *)old, size); put(e.c, (uint64_t)p); }
              else if (size >= minsize) { p = malloc(size); put(e.c, (uint64_t)p); }
              break;
    }
    if (size >= 65536) { struct mallinfo2 m = mallinfo2(); size_t h = m.arena + m.hblkhd; if (h > peak) { peak = h; live_at = m.uordblks + m.hblkhd; }
      if (m.hblkhd > last_h) fresh += m.hblkhd - last_h; if (m.arena > last_a) fresh += m.arena - last_a; last_h = m.hblkhd; last_a = m.arena; }
  }
  return 0;
}
