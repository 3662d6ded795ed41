// What the emulated kernel checks (scan_check.cpp, ssd_check.cpp) share:
// their random inputs, the error measure against their f64 oracles, a
// digest of the bits they produce, and the line each shape prints.
#pragma once
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <initializer_list>
#include <random>
#include <vector>

// `len` values uniform in [lo, hi) from `rng`, each exactly a float (the
// kernels get the float, the oracle the same value in f64).
static std::vector<double> uniform_floats(std::mt19937_64& rng, double lo, double hi,
                                          size_t len) {
    std::vector<double> v(len);
    std::uniform_real_distribution<double> u(lo, hi);
    for (auto& x : v) x = (double)(float)u(rng);
    return v;
}

// ||got - want|| / ||want|| (relative L2; the plain norm when want is 0);
// infinite when got holds a value that is not finite.
static double rel_l2(const std::vector<float>& got, const std::vector<double>& want) {
    double num = 0, den = 0;
    for (size_t i = 0; i < want.size(); ++i) {
        if (!std::isfinite(got[i])) return INFINITY;
        const double e = got[i] - want[i];
        num += e * e;
        den += want[i] * want[i];
    }
    return std::sqrt(num / (den > 0 ? den : 1));
}

// One quantity's error against its tolerance.
struct Check {
    const char* what;
    double err, tol;
};

// Print " what err" for each check (" FAIL" past its tolerance), then
// " bits <FNV-1a over every output's bits>" and a newline; returns the
// failures. The digest lets a change meant to keep the bits be compared
// against the previous revision of the kernels compiled here (the host's
// math library is the same for both; not the GPU's bits).
static int report(std::initializer_list<Check> checks,
                  std::initializer_list<const std::vector<float>*> outputs) {
    int fails = 0;
    for (const Check& k : checks) {
        const bool bad = !(k.err <= k.tol);
        fails += bad;
        printf(" %s %.1e%s", k.what, k.err, bad ? " FAIL" : "");
    }
    uint64_t h = 0xcbf29ce484222325ULL;
    for (const auto* v : outputs)
        for (float x : *v) {
            uint32_t b;
            std::memcpy(&b, &x, 4);
            for (int i = 0; i < 4; ++i) h = (h ^ ((b >> (8 * i)) & 0xff)) * 0x100000001b3ULL;
        }
    printf(" bits %016llx\n", (unsigned long long)h);
    fflush(stdout);
    return fails;
}
