/*
 * A disk whose every sync takes at least ROTA_SLOW_SYNC_US microseconds:
 * loaded with LD_PRELOAD into a process (a rota replica in
 * deploy/bench/slow-disk.sh), fsync and fdatasync do the real sync, then
 * sleep out whatever is left of that time. Unlike an IOPS throttle, which
 * lets bursts through and then holds writes back, every sync is slowed
 * alike, as on a network block device; each process is its own disk, so
 * the replicas' syncs do not queue behind one another's delay.
 *
 * Built by slow-disk.sh: cc -shared -fPIC -O2 -o slow-sync.so slow-sync.c -ldl
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <stdlib.h>
#include <time.h>

static long long delay_ns;
static int (*real_fsync)(int);
static int (*real_fdatasync)(int);

__attribute__((constructor)) static void slow_sync_init(void) {
    const char *text = getenv("ROTA_SLOW_SYNC_US");
    long long us = text ? atoll(text) : 0;
    /* At most ten seconds: a typo must not hang the replicas for hours. */
    if (us < 0) us = 0;
    if (us > 10000000) us = 10000000;
    delay_ns = us * 1000;
    real_fsync = (int (*)(int))dlsym(RTLD_NEXT, "fsync");
    real_fdatasync = (int (*)(int))dlsym(RTLD_NEXT, "fdatasync");
}

static long long now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (long long)t.tv_sec * 1000000000LL + t.tv_nsec;
}

/* Sleep until `delay_ns` has passed since `start_ns`, keeping errno. */
static void pad(long long start_ns) {
    int saved = errno;
    for (int tries = 0; tries < 100; tries++) {
        long long left = start_ns + delay_ns - now_ns();
        if (left <= 0) break;
        struct timespec t = {left / 1000000000LL, left % 1000000000LL};
        nanosleep(&t, NULL);
    }
    errno = saved;
}

int fsync(int fd) {
    long long start = now_ns();
    int result = real_fsync(fd);
    pad(start);
    return result;
}

int fdatasync(int fd) {
    long long start = now_ns();
    int result = real_fdatasync(fd);
    pad(start);
    return result;
}
