// mlx-lily Metal emulator: a shim that lets clang compile an MLX-rendered
// Metal kernel as C++ for the CPU. It provides the MSL types (half, bfloat,
// vectors, packed vectors, simdgroup_matrix, atomics), the metal:: math
// library, barriers and simd_* collectives (rendezvous points served by the
// fiber runtime), and the part of MLX's utils.h preamble that kernels use.
// Only compiler builtins are used: no C or C++ library headers.
#pragma once
#include "emu_abi.h"

// ------------------------------------------------------------------ scalar types
typedef __INT8_TYPE__ int8_t;
typedef __INT16_TYPE__ int16_t;
typedef __INT32_TYPE__ int32_t;
typedef __INT64_TYPE__ int64_t;
typedef __UINT8_TYPE__ uint8_t;
typedef __UINT16_TYPE__ uint16_t;
typedef __UINT32_TYPE__ uint32_t;
typedef __UINT64_TYPE__ uint64_t;
typedef __SIZE_TYPE__ size_t;
typedef __PTRDIFF_TYPE__ ptrdiff_t;
typedef __INTPTR_TYPE__ intptr_t;
typedef __UINTPTR_TYPE__ uintptr_t;
typedef unsigned int uint;
typedef unsigned short ushort;
typedef unsigned char uchar;
typedef unsigned long ulong;
typedef _Float16 half;
typedef __bf16 bfloat;
typedef half float16_t;
typedef bfloat bfloat16_t;

#define METAL_FUNC inline __attribute__((always_inline))
#define MLX_MTL_PRAGMA_UNROLL _Pragma("clang loop unroll(full)")
#define MLX_MTL_CONST static constant constexpr const
#define MLX_MTL_LOOP_UNROLL _Pragma("clang loop unroll(full)")

// ------------------------------------------------------------------ constants
#define INFINITY (__builtin_inff())
#define NAN (__builtin_nanf(""))
#define HUGE_VALF (__builtin_huge_valf())
#define MAXFLOAT (__FLT_MAX__)
#define FLT_MAX (__FLT_MAX__)
#define FLT_MIN (__FLT_MIN__)
#define FLT_EPSILON (__FLT_EPSILON__)
#define HALF_MAX ((half)65504.0f)
#define HALF_MIN ((half)6.103515625e-05f)
#define HALF_EPSILON ((half)0.0009765625f)
#define INT_MAX (__INT_MAX__)
#define INT_MIN (-__INT_MAX__ - 1)
#define UINT_MAX (__INT_MAX__ * 2u + 1u)
#define SHRT_MAX (__SHRT_MAX__)
#define SHRT_MIN (-__SHRT_MAX__ - 1)
#define USHRT_MAX (__SHRT_MAX__ * 2 + 1)
#define CHAR_BIT 8
#define M_E_F 2.71828182845904523536f
#define M_LOG2E_F 1.44269504088896340736f
#define M_LOG10E_F 0.434294481903251827651f
#define M_LN2_F 0.693147180559945309417f
#define M_LN10_F 2.30258509299404568402f
#define M_PI_F 3.14159265358979323846f
#define M_PI_2_F 1.57079632679489661923f
#define M_PI_4_F 0.785398163397448309616f
#define M_1_PI_F 0.318309886183790671538f
#define M_2_PI_F 0.636619772367581343076f
#define M_2_SQRTPI_F 1.12837916709551257390f
#define M_SQRT2_F 1.41421356237309504880f
#define M_SQRT1_2_F 0.707106781186547524401f

namespace metal {

// ------------------------------------------------------------------ type traits
template <class T, T v>
struct integral_constant {
  static constexpr T value = v;
  constexpr operator T() const { return v; }
};
typedef integral_constant<bool, true> true_type;
typedef integral_constant<bool, false> false_type;
template <class A, class B> struct is_same : false_type {};
template <class A> struct is_same<A, A> : true_type {};
template <class A, class B> constexpr bool is_same_v = is_same<A, B>::value;
template <bool B, class T = void> struct enable_if {};
template <class T> struct enable_if<true, T> { typedef T type; };
template <bool B, class T = void> using enable_if_t = typename enable_if<B, T>::type;
template <bool B, class T, class F> struct conditional { typedef T type; };
template <class T, class F> struct conditional<false, T, F> { typedef F type; };
template <bool B, class T, class F> using conditional_t = typename conditional<B, T, F>::type;
template <class T> struct remove_const { typedef T type; };
template <class T> struct remove_const<const T> { typedef T type; };
template <class T> struct remove_volatile { typedef T type; };
template <class T> struct remove_volatile<volatile T> { typedef T type; };
template <class T> struct remove_cv { typedef typename remove_volatile<typename remove_const<T>::type>::type type; };
template <class T> using remove_cv_t = typename remove_cv<T>::type;
template <class T> struct remove_reference { typedef T type; };
template <class T> struct remove_reference<T&> { typedef T type; };
template <class T> struct remove_reference<T&&> { typedef T type; };
template <class T> using remove_reference_t = typename remove_reference<T>::type;
template <class T> struct remove_pointer { typedef T type; };
template <class T> struct remove_pointer<T*> { typedef T type; };
template <class T> struct remove_pointer<T* const> { typedef T type; };
template <class T> using remove_pointer_t = typename remove_pointer<T>::type;
template <class T> struct decay { typedef remove_cv_t<remove_reference_t<T>> type; };
template <class T> using decay_t = typename decay<T>::type;
template <class T> struct type_identity { typedef T type; };

template <class T> struct __is_fp : false_type {};
template <> struct __is_fp<float> : true_type {};
template <> struct __is_fp<half> : true_type {};
template <> struct __is_fp<bfloat> : true_type {};
template <> struct __is_fp<double> : true_type {};
template <class T> struct __is_int : false_type {};
template <> struct __is_int<bool> : true_type {};
template <> struct __is_int<char> : true_type {};
template <> struct __is_int<signed char> : true_type {};
template <> struct __is_int<unsigned char> : true_type {};
template <> struct __is_int<short> : true_type {};
template <> struct __is_int<unsigned short> : true_type {};
template <> struct __is_int<int> : true_type {};
template <> struct __is_int<unsigned int> : true_type {};
template <> struct __is_int<long> : true_type {};
template <> struct __is_int<unsigned long> : true_type {};
template <> struct __is_int<long long> : true_type {};
template <> struct __is_int<unsigned long long> : true_type {};
template <class T> struct is_floating_point : __is_fp<remove_cv_t<T>> {};
template <class T> struct is_integral : __is_int<remove_cv_t<T>> {};
template <class T> struct is_arithmetic : integral_constant<bool, is_floating_point<T>::value || is_integral<T>::value> {};
template <class T> constexpr bool is_floating_point_v = is_floating_point<T>::value;
template <class T> constexpr bool is_integral_v = is_integral<T>::value;
template <class T> constexpr bool is_arithmetic_v = is_arithmetic<T>::value;
template <class T> struct is_signed : integral_constant<bool, is_floating_point<T>::value || (is_integral<T>::value && T(-1) < T(0))> {};
template <class T> struct is_unsigned : integral_constant<bool, is_integral<T>::value && !(T(-1) < T(0))> {};
template <class T> constexpr bool is_signed_v = is_signed<T>::value;
template <class T> constexpr bool is_unsigned_v = is_unsigned<T>::value;
template <class T> struct is_pointer : false_type {};
template <class T> struct is_pointer<T*> : true_type {};
template <class T> constexpr bool is_pointer_v = is_pointer<T>::value;
template <class T> struct make_unsigned { typedef T type; };
template <> struct make_unsigned<int> { typedef unsigned int type; };
template <> struct make_unsigned<short> { typedef unsigned short type; };
template <> struct make_unsigned<signed char> { typedef unsigned char type; };
template <> struct make_unsigned<char> { typedef unsigned char type; };
template <> struct make_unsigned<long> { typedef unsigned long type; };
template <class T> using make_unsigned_t = typename make_unsigned<T>::type;

// ------------------------------------------------------------------ vectors
template <class T, int N> using vec = T __attribute__((ext_vector_type(N)));

template <class T> struct __vt { static constexpr bool is = false; static constexpr int n = 1; typedef T elem; };
template <class T, int N> struct __vt<vec<T, N>> { static constexpr bool is = true; static constexpr int n = N; typedef T elem; };
template <class T> constexpr bool __is_vec = __vt<remove_cv_t<remove_reference_t<T>>>::is;
template <class T> struct is_vector : integral_constant<bool, __is_vec<T>> {};
template <class T> constexpr bool is_vector_v = __is_vec<T>;

#define __EMU_VEC_TYPES(S, P)        \
  typedef vec<S, 2> P##2;            \
  typedef vec<S, 3> P##3;            \
  typedef vec<S, 4> P##4;
__EMU_VEC_TYPES(float, float)
__EMU_VEC_TYPES(half, half)
__EMU_VEC_TYPES(bfloat, bfloat)
__EMU_VEC_TYPES(int, int)
__EMU_VEC_TYPES(uint, uint)
__EMU_VEC_TYPES(short, short)
__EMU_VEC_TYPES(ushort, ushort)
__EMU_VEC_TYPES(char, char)
__EMU_VEC_TYPES(uchar, uchar)
__EMU_VEC_TYPES(bool, bool)
__EMU_VEC_TYPES(long, long)
__EMU_VEC_TYPES(ulong, ulong)
#undef __EMU_VEC_TYPES

// packed vectors: the alignment of the element; 3-element ones are 3 elements long.
template <class T>
struct __packed3 {
  T x, y, z;
  __packed3() = default;
  __packed3(vec<T, 3> v) : x(v.x), y(v.y), z(v.z) {}
  operator vec<T, 3>() const { return vec<T, 3>{x, y, z}; }
  T& operator[](int i) { return (&x)[i]; }
  const T& operator[](int i) const { return (&x)[i]; }
};
#define __EMU_PACKED_TYPES(S, P)                                                  \
  typedef S packed_##P##2 __attribute__((ext_vector_type(2), aligned(sizeof(S)))); \
  typedef S packed_##P##4 __attribute__((ext_vector_type(4), aligned(sizeof(S)))); \
  typedef __packed3<S> packed_##P##3;
__EMU_PACKED_TYPES(float, float)
__EMU_PACKED_TYPES(half, half)
__EMU_PACKED_TYPES(bfloat, bfloat)
__EMU_PACKED_TYPES(int, int)
__EMU_PACKED_TYPES(uint, uint)
__EMU_PACKED_TYPES(short, short)
__EMU_PACKED_TYPES(ushort, ushort)
__EMU_PACKED_TYPES(char, char)
__EMU_PACKED_TYPES(uchar, uchar)
#undef __EMU_PACKED_TYPES

// ------------------------------------------------------------------ numeric_limits
template <class T> struct numeric_limits;
#define __EMU_INT_LIMITS(T, MN, MX)                                \
  template <> struct numeric_limits<T> {                           \
    static constexpr bool is_specialized = true;                   \
    static constexpr bool is_signed = (T)(-1) < (T)0;              \
    static constexpr bool is_integer = true;                       \
    static constexpr T min() { return MN; }                        \
    static constexpr T max() { return MX; }                        \
    static constexpr T lowest() { return MN; }                     \
  };
__EMU_INT_LIMITS(bool, false, true)
__EMU_INT_LIMITS(char, (char)(-128), (char)127)
__EMU_INT_LIMITS(signed char, (signed char)(-128), (signed char)127)
__EMU_INT_LIMITS(unsigned char, (unsigned char)0, (unsigned char)255)
__EMU_INT_LIMITS(short, (short)(-32768), (short)32767)
__EMU_INT_LIMITS(unsigned short, (unsigned short)0, (unsigned short)65535)
__EMU_INT_LIMITS(int, (-2147483647 - 1), 2147483647)
__EMU_INT_LIMITS(unsigned int, 0u, 4294967295u)
__EMU_INT_LIMITS(long, (-9223372036854775807L - 1), 9223372036854775807L)
__EMU_INT_LIMITS(unsigned long, 0ul, 18446744073709551615ul)
__EMU_INT_LIMITS(long long, (-9223372036854775807LL - 1), 9223372036854775807LL)
__EMU_INT_LIMITS(unsigned long long, 0ull, 18446744073709551615ull)
#undef __EMU_INT_LIMITS
#define __EMU_FP_LIMITS(T, BITS, MIN_BITS, MAX_BITS, EPS_BITS, QNAN_BITS, INF_BITS, LOW_BITS) \
  template <> struct numeric_limits<T> {                                                    \
    static constexpr bool is_specialized = true;                                            \
    static constexpr bool is_signed = true;                                                 \
    static constexpr bool is_integer = false;                                               \
    static constexpr bool has_infinity = true;                                              \
    static constexpr bool has_quiet_NaN = true;                                             \
    static constexpr T min() { return __builtin_bit_cast(T, (BITS)MIN_BITS); }              \
    static constexpr T max() { return __builtin_bit_cast(T, (BITS)MAX_BITS); }              \
    static constexpr T lowest() { return __builtin_bit_cast(T, (BITS)LOW_BITS); }           \
    static constexpr T epsilon() { return __builtin_bit_cast(T, (BITS)EPS_BITS); }          \
    static constexpr T infinity() { return __builtin_bit_cast(T, (BITS)INF_BITS); }         \
    static constexpr T quiet_NaN() { return __builtin_bit_cast(T, (BITS)QNAN_BITS); }       \
    static constexpr T denorm_min() { return __builtin_bit_cast(T, (BITS)1); }              \
  };
__EMU_FP_LIMITS(float, unsigned int, 0x00800000u, 0x7f7fffffu, 0x34000000u, 0x7fc00000u, 0x7f800000u, 0xff7fffffu)
__EMU_FP_LIMITS(half, unsigned short, 0x0400, 0x7bff, 0x1400, 0x7e00, 0x7c00, 0xfbff)
__EMU_FP_LIMITS(bfloat, unsigned short, 0x0080, 0x7f7f, 0x3c00, 0x7fc0, 0x7f80, 0xff7f)
#undef __EMU_FP_LIMITS

}  // namespace metal

// ------------------------------------------------------------------ emulator helpers
namespace __emu {
using metal::__vt;
using metal::remove_cv_t;
using metal::remove_reference_t;

template <class A> struct __p3 { static constexpr bool is = false; };
template <class E> struct __p3<metal::__packed3<E>> { static constexpr bool is = true; };
template <class T, int N>
struct vbuild {
  T v[N];
  int n;
};
template <class T, int N, class A>
inline void vpush(vbuild<T, N>& b, const A& a) {
  if constexpr (__vt<A>::is) {
    for (int i = 0; i < __vt<A>::n; ++i) b.v[b.n++] = (T)a[i];
  } else if constexpr (__p3<A>::is) {
    for (int i = 0; i < 3; ++i) b.v[b.n++] = (T)a[i];  // packed 3-vectors
  } else {
    b.v[b.n++] = (T)a;
  }
}
template <class A> inline const A& __first(const A& a) { return a; }
template <class A> constexpr int vcomp() { return __p3<A>::is ? 3 : __vt<A>::n; }

// MSL vector constructors: float4(x) splats, float4(v) converts, float4(a, b.xy, c) concatenates.
template <class T, int N, class... A>
inline metal::vec<T, N> make_vec(const A&... a) {
  typedef metal::vec<T, N> V;
  if constexpr (sizeof...(A) == 0) {
    return V{};
  } else if constexpr (sizeof...(A) == 1 && !((__vt<A>::is || __p3<A>::is) && ...)) {
    return (V)((T)(a, ...));
  } else if constexpr (sizeof...(A) == 1 && (__vt<A>::is && ...)) {
    static_assert(((vcomp<A>() == N) && ...), "vector conversion changes the number of components");
    return __builtin_convertvector(__first(a...), V);
  } else {
    static_assert((0 + ... + vcomp<A>()) == N, "vector constructor: wrong number of components");
    vbuild<T, N> b;
    b.n = 0;
    (vpush(b, a), ...);
    V r;
    for (int i = 0; i < N; ++i) r[i] = b.v[i];
    return r;
  }
}

// static_cast that also converts between vector types, like MSL's.
template <class To, class From>
constexpr inline To scast(From&& x) {
  typedef remove_cv_t<remove_reference_t<From>> F;
  typedef remove_cv_t<To> T;
  if constexpr (__vt<T>::is && __vt<F>::is) {
    return __builtin_convertvector(x, T);
  } else if constexpr (__vt<T>::is) {
    return (T)((typename __vt<T>::elem)x);
  } else {
    return static_cast<To>(static_cast<From&&>(x));
  }
}

template <class T> inline T ld(const unsigned char* p) { T v; __builtin_memcpy((void*)&v, p, sizeof(T)); return v; }
template <class T> inline void st(unsigned char* p, const T& v) { __builtin_memcpy(p, (const void*)&v, sizeof(T)); }
template <class T> inline T poison() { T v; __builtin_memset((void*)&v, 0xFF, sizeof(T)); return v; }
}  // namespace __emu

namespace metal {

template <class To, class From>
inline To as_type(const From& x) {
  static_assert(sizeof(To) == sizeof(From), "as_type: the two types differ in size");
  return __builtin_bit_cast(To, x);
}

// ------------------------------------------------------------------ math
#define __EMU_MAP1(NAME)                                                                     \
  template <class T, int N> inline vec<T, N> NAME(vec<T, N> v) {                             \
    vec<T, N> r;                                                                             \
    for (int i = 0; i < N; ++i) r[i] = NAME(v[i]);                                           \
    return r;                                                                                \
  }
#define __EMU_UNARY(NAME, EXPR)                                                              \
  inline float NAME(float x) { return EXPR; }                                                \
  inline half NAME(half x) { return (half)NAME((float)x); }                                  \
  inline bfloat NAME(bfloat x) { return (bfloat)NAME((float)x); }                            \
  __EMU_MAP1(NAME)

__EMU_UNARY(exp, __builtin_expf(x))
__EMU_UNARY(exp2, __builtin_exp2f(x))
__EMU_UNARY(exp10, __builtin_powf(10.0f, x))
__EMU_UNARY(log, __builtin_logf(x))
__EMU_UNARY(log2, __builtin_log2f(x))
__EMU_UNARY(log10, __builtin_log10f(x))
__EMU_UNARY(sqrt, __builtin_sqrtf(x))
__EMU_UNARY(rsqrt, 1.0f / __builtin_sqrtf(x))
__EMU_UNARY(sin, __builtin_sinf(x))
__EMU_UNARY(cos, __builtin_cosf(x))
__EMU_UNARY(tan, __builtin_tanf(x))
__EMU_UNARY(asin, __builtin_asinf(x))
__EMU_UNARY(acos, __builtin_acosf(x))
__EMU_UNARY(atan, __builtin_atanf(x))
__EMU_UNARY(sinh, __builtin_sinhf(x))
__EMU_UNARY(cosh, __builtin_coshf(x))
__EMU_UNARY(tanh, __builtin_tanhf(x))
__EMU_UNARY(asinh, __builtin_asinhf(x))
__EMU_UNARY(acosh, __builtin_acoshf(x))
__EMU_UNARY(atanh, __builtin_atanhf(x))
__EMU_UNARY(sinpi, __builtin_sinf(x * M_PI_F))
__EMU_UNARY(cospi, __builtin_cosf(x * M_PI_F))
__EMU_UNARY(tanpi, __builtin_tanf(x * M_PI_F))
__EMU_UNARY(floor, __builtin_floorf(x))
__EMU_UNARY(ceil, __builtin_ceilf(x))
__EMU_UNARY(round, __builtin_roundf(x))
__EMU_UNARY(rint, __builtin_rintf(x))
__EMU_UNARY(trunc, __builtin_truncf(x))
__EMU_UNARY(fabs, __builtin_fabsf(x))
__EMU_UNARY(fract, __builtin_fminf(x - __builtin_floorf(x), 0x1.fffffep-1f))
__EMU_UNARY(saturate, __builtin_fminf(__builtin_fmaxf(x, 0.0f), 1.0f))
__EMU_UNARY(sign, (x > 0.0f ? 1.0f : (x < 0.0f ? -1.0f : (x == x ? x : 0.0f))))
#undef __EMU_UNARY

// abs: floats and integers
template <class T, enable_if_t<is_arithmetic_v<T>, int> = 0>
inline T abs(T x) {
  if constexpr (is_floating_point_v<T>) return (T)__builtin_fabsf((float)x);
  else return x < T(0) ? T(-x) : x;
}
__EMU_MAP1(abs)

#define __EMU_PRED(NAME, EXPR)                                                               \
  inline bool NAME(float x) { return EXPR; }                                                 \
  inline bool NAME(half x) { return NAME((float)x); }                                        \
  inline bool NAME(bfloat x) { return NAME((float)x); }                                      \
  template <class T, int N> inline vec<bool, N> NAME(vec<T, N> v) {                          \
    vec<bool, N> r;                                                                          \
    for (int i = 0; i < N; ++i) r[i] = NAME(v[i]);                                           \
    return r;                                                                                \
  }
__EMU_PRED(isnan, __builtin_isnan(x))
__EMU_PRED(isinf, __builtin_isinf(x))
__EMU_PRED(isfinite, __builtin_isfinite(x))
__EMU_PRED(isnormal, __builtin_isnormal(x))
__EMU_PRED(signbit, __builtin_signbit(x))
#undef __EMU_PRED

// Elementwise application with scalar broadcast, for binary and ternary functions.
template <class T> inline auto __el(const T& x, int i) {
  if constexpr (__vt<T>::is) return x[i];
  else return x;
}
template <class A, class B> struct __vres { typedef conditional_t<__vt<A>::is, A, B> type; };

#define __EMU_BINARY(NAME, EXPR)                                                             \
  inline float NAME(float x, float y) { return EXPR; }                                       \
  inline half NAME(half x, half y) { return (half)NAME((float)x, (float)y); }                \
  inline bfloat NAME(bfloat x, bfloat y) { return (bfloat)NAME((float)x, (float)y); }        \
  template <class A, class B, enable_if_t<__vt<A>::is || __vt<B>::is, int> = 0>              \
  inline typename __vres<A, B>::type NAME(A a, B b) {                                        \
    typename __vres<A, B>::type r;                                                           \
    for (int i = 0; i < __vt<typename __vres<A, B>::type>::n; ++i)                           \
      r[i] = NAME(__el(a, i), __el(b, i));                                                   \
    return r;                                                                                \
  }
__EMU_BINARY(pow, __builtin_powf(x, y))
__EMU_BINARY(powr, __builtin_powf(x, y))
__EMU_BINARY(fmin, __builtin_fminf(x, y))
__EMU_BINARY(fmax, __builtin_fmaxf(x, y))
__EMU_BINARY(fmod, __builtin_fmodf(x, y))
__EMU_BINARY(atan2, __builtin_atan2f(x, y))
__EMU_BINARY(copysign, __builtin_copysignf(x, y))
__EMU_BINARY(fdim, __builtin_fdimf(x, y))
__EMU_BINARY(step, (y < x ? 0.0f : 1.0f))
__EMU_BINARY(divide, (x / y))
#undef __EMU_BINARY

// min / max / clamp for every arithmetic type (floats follow fmin/fmax: a NaN operand is ignored)
template <class T, enable_if_t<is_arithmetic_v<T>, int> = 0>
inline T min(T a, T b) {
  if constexpr (is_floating_point_v<T>) return (T)__builtin_fminf((float)a, (float)b);
  else return b < a ? b : a;
}
template <class T, enable_if_t<is_arithmetic_v<T>, int> = 0>
inline T max(T a, T b) {
  if constexpr (is_floating_point_v<T>) return (T)__builtin_fmaxf((float)a, (float)b);
  else return a < b ? b : a;
}
template <class A, class B, enable_if_t<__vt<A>::is || __vt<B>::is, int> = 0>
inline typename __vres<A, B>::type min(A a, B b) {
  typename __vres<A, B>::type r;
  for (int i = 0; i < __vt<typename __vres<A, B>::type>::n; ++i) r[i] = min(__el(a, i), __el(b, i));
  return r;
}
template <class A, class B, enable_if_t<__vt<A>::is || __vt<B>::is, int> = 0>
inline typename __vres<A, B>::type max(A a, B b) {
  typename __vres<A, B>::type r;
  for (int i = 0; i < __vt<typename __vres<A, B>::type>::n; ++i) r[i] = max(__el(a, i), __el(b, i));
  return r;
}
template <class T, class L, class H>
inline T clamp(T x, L lo, H hi) {
  if constexpr (__vt<T>::is) {
    T r;
    for (int i = 0; i < __vt<T>::n; ++i) r[i] = clamp(x[i], __el(lo, i), __el(hi, i));
    return r;
  } else {
    return min(max(x, (T)lo), (T)hi);
  }
}

template <class T, class U>
inline T fma(T a, U b, T c) {
  if constexpr (__vt<T>::is) {
    T r;
    for (int i = 0; i < __vt<T>::n; ++i) r[i] = fma(a[i], __el(b, i), c[i]);
    return r;
  } else {
    return (T)__builtin_fmaf((float)a, (float)b, (float)c);
  }
}
template <class T, class A>
inline T mix(T x, T y, A a) {
  if constexpr (__vt<T>::is) {
    T r;
    for (int i = 0; i < __vt<T>::n; ++i) r[i] = mix(x[i], y[i], __el(a, i));
    return r;
  } else {
    return (T)((float)x + ((float)y - (float)x) * (float)a);
  }
}
template <class T, class E>
inline T smoothstep(E e0, E e1, T x) {
  if constexpr (__vt<T>::is) {
    T r;
    for (int i = 0; i < __vt<T>::n; ++i) r[i] = smoothstep(__el(e0, i), __el(e1, i), x[i]);
    return r;
  } else {
    float t = __builtin_fminf(__builtin_fmaxf(((float)x - (float)e0) / ((float)e1 - (float)e0), 0.0f), 1.0f);
    return (T)(t * t * (3.0f - 2.0f * t));
  }
}
template <class T, class C>
inline T select(T a, T b, C c) {
  if constexpr (__vt<T>::is) {
    T r;
    for (int i = 0; i < __vt<T>::n; ++i) r[i] = __el(c, i) ? b[i] : a[i];
    return r;
  } else {
    return c ? b : a;
  }
}
template <class T> inline T ldexp(T x, int e) { return (T)__builtin_ldexpf((float)x, e); }

// integer bit functions
template <class T> inline T popcount(T x) {
  if constexpr (__vt<T>::is) { T r; for (int i = 0; i < __vt<T>::n; ++i) r[i] = popcount(x[i]); return r; }
  else if constexpr (sizeof(T) == 8) return (T)__builtin_popcountll((unsigned long long)x);
  else return (T)__builtin_popcount((unsigned)(make_unsigned_t<T>)x);
}
template <class T> inline T clz(T x) {
  if constexpr (__vt<T>::is) { T r; for (int i = 0; i < __vt<T>::n; ++i) r[i] = clz(x[i]); return r; }
  else if constexpr (sizeof(T) == 8) return x == 0 ? (T)64 : (T)__builtin_clzll((unsigned long long)x);
  else return x == 0 ? (T)(8 * sizeof(T)) : (T)(__builtin_clz((unsigned)(make_unsigned_t<T>)x) - (32 - 8 * sizeof(T)));
}
template <class T> inline T ctz(T x) {
  if constexpr (__vt<T>::is) { T r; for (int i = 0; i < __vt<T>::n; ++i) r[i] = ctz(x[i]); return r; }
  else if constexpr (sizeof(T) == 8) return x == 0 ? (T)64 : (T)__builtin_ctzll((unsigned long long)x);
  else return x == 0 ? (T)(8 * sizeof(T)) : (T)__builtin_ctz((unsigned)(make_unsigned_t<T>)x);
}
inline uint mulhi(uint a, uint b) { return (uint)(((unsigned long long)a * b) >> 32); }
inline int mulhi(int a, int b) { return (int)(((long long)a * b) >> 32); }

// geometric / reductions over vector components
template <class T, int N> inline T dot(vec<T, N> a, vec<T, N> b) {
  float s = 0.0f;
  for (int i = 0; i < N; ++i) s += (float)a[i] * (float)b[i];
  return (T)s;
}
template <class T, int N> inline T length_squared(vec<T, N> a) { return dot(a, a); }
template <class T, int N> inline T length(vec<T, N> a) { return (T)__builtin_sqrtf((float)dot(a, a)); }
template <class T, int N> inline T distance(vec<T, N> a, vec<T, N> b) { return length(a - b); }
template <class T, int N> inline vec<T, N> normalize(vec<T, N> a) { return a * (T)(1.0f / (float)length(a)); }
template <class T> inline vec<T, 3> cross(vec<T, 3> a, vec<T, 3> b) {
  return vec<T, 3>{a.y * b.z - a.z * b.y, a.z * b.x - a.x * b.z, a.x * b.y - a.y * b.x};
}
template <class T, int N> inline bool all(vec<T, N> v) { for (int i = 0; i < N; ++i) if (!v[i]) return false; return true; }
template <class T, int N> inline bool any(vec<T, N> v) { for (int i = 0; i < N; ++i) if (v[i]) return true; return false; }
inline bool all(bool b) { return b; }
inline bool any(bool b) { return b; }

namespace fast {
using metal::exp; using metal::exp2; using metal::exp10; using metal::log; using metal::log2; using metal::log10;
using metal::sqrt; using metal::rsqrt; using metal::sin; using metal::cos; using metal::tan; using metal::tanh;
using metal::sinh; using metal::cosh; using metal::asin; using metal::acos; using metal::atan; using metal::atan2;
using metal::pow; using metal::powr; using metal::fmin; using metal::fmax; using metal::min; using metal::max;
using metal::clamp; using metal::floor; using metal::ceil; using metal::round; using metal::rint; using metal::trunc;
using metal::fabs; using metal::abs; using metal::fract; using metal::saturate; using metal::sign; using metal::divide;
using metal::fmod; using metal::sinpi; using metal::cospi; using metal::tanpi; using metal::normalize; using metal::length;
using metal::distance; using metal::copysign; using metal::fdim; using metal::step; using metal::smoothstep;
}  // namespace fast
namespace precise {
using namespace metal::fast;
}  // namespace precise

// ------------------------------------------------------------------ barriers
enum class mem_flags : unsigned {
  mem_none = 0,
  mem_device = 1,
  mem_threadgroup = 2,
  mem_texture = 4,
  mem_threadgroup_imageblock = 8,
  mem_object_data = 16,
};
constexpr mem_flags operator|(mem_flags a, mem_flags b) { return (mem_flags)((unsigned)a | (unsigned)b); }
constexpr mem_flags operator&(mem_flags a, mem_flags b) { return (mem_flags)((unsigned)a & (unsigned)b); }

inline void threadgroup_barrier(mem_flags = mem_flags::mem_none, int __line = __builtin_LINE(),
                                const char* __file = __builtin_FILE()) {
  __emu_tg_barrier("threadgroup_barrier", __line, __file);
}

// ------------------------------------------------------------------ simd collectives
namespace __simd {
using __emu::ld;
using __emu::st;
using __emu::poison;

template <class T>
inline T collective(const T& x, int param, __emu_compute_fn fn, const char* op, int line, const char* file) {
  static_assert(sizeof(T) <= __EMU_SLOT, "simd collective on a type larger than the emulator's slot");
  __emu_u32 lane;
  __emu_simd_xchg* g = __emu_simd_enter(&lane);
  st(g->in[lane], x);
  g->param[lane] = param;
  __emu_simd_sync(fn, op, line, file);
  return ld<T>(g->out[lane]);
}
inline void c_none(__emu_simd_xchg*) {}

template <class T> inline T add(T a, T b) { return a + b; }
template <class T> inline T mul(T a, T b) { return a * b; }
template <class T> inline T band(T a, T b) { return a & b; }
template <class T> inline T bor(T a, T b) { return a | b; }
template <class T> inline T bxor(T a, T b) { return a ^ b; }
template <class T> inline T vmin(T a, T b) { return metal::min(a, b); }
template <class T> inline T vmax(T a, T b) { return metal::max(a, b); }

// Reductions as the ascending xor butterfly (1, 2, 4, 8, 16); lanes that do not
// exist (short last simdgroup) hold the identity.
template <class T, T (*OP)(T, T), int ID>
void c_butterfly(__emu_simd_xchg* g) {
  T v[32];
  for (int i = 0; i < 32; ++i) v[i] = i < g->nlanes ? ld<T>(g->in[i]) : (T)ID;
  for (int m = 1; m < 32; m <<= 1) {
    T w[32];
    for (int i = 0; i < 32; ++i) w[i] = OP(v[i], v[i ^ m]);
    for (int i = 0; i < 32; ++i) v[i] = w[i];
  }
  for (int i = 0; i < g->nlanes; ++i) st(g->out[i], v[i]);
}
// Order-free reductions (exact): fold the existing lanes.
template <class T, T (*OP)(T, T)>
void c_fold(__emu_simd_xchg* g) {
  T acc = ld<T>(g->in[0]);
  for (int i = 1; i < g->nlanes; ++i) acc = OP(acc, ld<T>(g->in[i]));
  for (int i = 0; i < g->nlanes; ++i) st(g->out[i], acc);
}
template <class T, T (*OP)(T, T), int ID, bool INCL>
void c_scan(__emu_simd_xchg* g) {
  T acc = (T)ID;
  for (int i = 0; i < g->nlanes; ++i) {
    T x = ld<T>(g->in[i]);
    if (INCL) {
      acc = i == 0 ? x : OP(acc, x);
      st(g->out[i], acc);
    } else {
      st(g->out[i], acc);
      acc = i == 0 ? x : OP(acc, x);
    }
  }
}
enum { SH_IDX = 0, SH_XOR = 1, SH_DOWN = 2, SH_UP = 3, SH_RDOWN = 4, SH_RUP = 5,
       Q_IDX = 6, Q_XOR = 7, Q_DOWN = 8, Q_UP = 9 };
template <class T, int KIND>
void c_shuffle(__emu_simd_xchg* g) {
  for (int i = 0; i < g->nlanes; ++i) {
    int p = g->param[i];
    int src;
    switch (KIND) {
      case SH_IDX: src = p; break;
      case SH_XOR: src = i ^ (p & 31); break;
      case SH_DOWN: src = i + p < 32 ? i + p : i; break;
      case SH_UP: src = i - p >= 0 ? i - p : i; break;
      case SH_RDOWN: src = (i + p) & 31; break;
      case SH_RUP: src = (i - p) & 31; break;
      case Q_IDX: src = (i & ~3) | (p & 3); break;
      case Q_XOR: src = i ^ (p & 3); break;
      case Q_DOWN: src = (i & 3) + p < 4 ? i + p : i; break;
      default: src = (i & 3) - p >= 0 ? i - p : i; break;
    }
    st(g->out[i], (src >= 0 && src < g->nlanes) ? ld<T>(g->in[src]) : poison<T>());
  }
}
template <class T, T (*OP)(T, T)>
void c_quad_butterfly(__emu_simd_xchg* g) {
  for (int i = 0; i < g->nlanes; ++i) {
    int b = i & ~3;
    T v[4];
    for (int j = 0; j < 4; ++j) v[j] = b + j < g->nlanes ? ld<T>(g->in[b + j]) : poison<T>();
    T s01 = OP(v[0], v[1]), s23 = OP(v[2], v[3]);
    st(g->out[i], OP(s01, s23));
  }
}
template <int KIND>  // 0 all, 1 any, 2 ballot
void c_vote(__emu_simd_xchg* g) {
  unsigned long long m = 0;
  for (int i = 0; i < g->nlanes; ++i) if (ld<bool>(g->in[i])) m |= 1ull << i;
  unsigned long long full = g->nlanes == 32 ? ~0ull >> 32 : ((1ull << g->nlanes) - 1);
  for (int i = 0; i < g->nlanes; ++i) {
    if (KIND == 0) st(g->out[i], m == full);
    else if (KIND == 1) st(g->out[i], m != 0);
    else st(g->out[i], m);
  }
}
template <class T>
void c_bcast(__emu_simd_xchg* g) {
  int src = g->param[0];
  T v = (src >= 0 && src < g->nlanes) ? ld<T>(g->in[src]) : poison<T>();
  for (int i = 0; i < g->nlanes; ++i) st(g->out[i], v);
}
}  // namespace __simd

#define __EMU_LOC int __line = __builtin_LINE(), const char *__file = __builtin_FILE()
#define __EMU_COLL(T, X, P, FN, NAME) __simd::collective<T>(X, P, FN, NAME, __line, __file)

template <class T> inline T simd_sum(T x, __EMU_LOC) { return __EMU_COLL(T, x, 0, (__simd::c_butterfly<T, __simd::add<T>, 0>), "simd_sum"); }
template <class T> inline T simd_product(T x, __EMU_LOC) { return __EMU_COLL(T, x, 0, (__simd::c_butterfly<T, __simd::mul<T>, 1>), "simd_product"); }
template <class T> inline T simd_max(T x, __EMU_LOC) { return __EMU_COLL(T, x, 0, (__simd::c_fold<T, __simd::vmax<T>>), "simd_max"); }
template <class T> inline T simd_min(T x, __EMU_LOC) { return __EMU_COLL(T, x, 0, (__simd::c_fold<T, __simd::vmin<T>>), "simd_min"); }
template <class T> inline T simd_and(T x, __EMU_LOC) { return __EMU_COLL(T, x, 0, (__simd::c_fold<T, __simd::band<T>>), "simd_and"); }
template <class T> inline T simd_or(T x, __EMU_LOC) { return __EMU_COLL(T, x, 0, (__simd::c_fold<T, __simd::bor<T>>), "simd_or"); }
template <class T> inline T simd_xor(T x, __EMU_LOC) { return __EMU_COLL(T, x, 0, (__simd::c_fold<T, __simd::bxor<T>>), "simd_xor"); }
template <class T> inline T simd_prefix_inclusive_sum(T x, __EMU_LOC) { return __EMU_COLL(T, x, 0, (__simd::c_scan<T, __simd::add<T>, 0, true>), "simd_prefix_inclusive_sum"); }
template <class T> inline T simd_prefix_exclusive_sum(T x, __EMU_LOC) { return __EMU_COLL(T, x, 0, (__simd::c_scan<T, __simd::add<T>, 0, false>), "simd_prefix_exclusive_sum"); }
template <class T> inline T simd_prefix_inclusive_product(T x, __EMU_LOC) { return __EMU_COLL(T, x, 0, (__simd::c_scan<T, __simd::mul<T>, 1, true>), "simd_prefix_inclusive_product"); }
template <class T> inline T simd_prefix_exclusive_product(T x, __EMU_LOC) { return __EMU_COLL(T, x, 0, (__simd::c_scan<T, __simd::mul<T>, 1, false>), "simd_prefix_exclusive_product"); }
template <class T> inline T simd_shuffle(T x, ushort lane, __EMU_LOC) { return __EMU_COLL(T, x, lane, (__simd::c_shuffle<T, __simd::SH_IDX>), "simd_shuffle"); }
template <class T> inline T simd_shuffle_xor(T x, ushort mask, __EMU_LOC) { return __EMU_COLL(T, x, mask, (__simd::c_shuffle<T, __simd::SH_XOR>), "simd_shuffle_xor"); }
template <class T> inline T simd_shuffle_down(T x, ushort delta, __EMU_LOC) { return __EMU_COLL(T, x, delta, (__simd::c_shuffle<T, __simd::SH_DOWN>), "simd_shuffle_down"); }
template <class T> inline T simd_shuffle_up(T x, ushort delta, __EMU_LOC) { return __EMU_COLL(T, x, delta, (__simd::c_shuffle<T, __simd::SH_UP>), "simd_shuffle_up"); }
template <class T> inline T simd_shuffle_rotate_down(T x, ushort delta, __EMU_LOC) { return __EMU_COLL(T, x, delta, (__simd::c_shuffle<T, __simd::SH_RDOWN>), "simd_shuffle_rotate_down"); }
template <class T> inline T simd_shuffle_rotate_up(T x, ushort delta, __EMU_LOC) { return __EMU_COLL(T, x, delta, (__simd::c_shuffle<T, __simd::SH_RUP>), "simd_shuffle_rotate_up"); }
template <class T> inline T simd_broadcast(T x, ushort lane, __EMU_LOC) { return __EMU_COLL(T, x, lane, (__simd::c_bcast<T>), "simd_broadcast"); }
template <class T> inline T simd_broadcast_first(T x, __EMU_LOC) { return __EMU_COLL(T, x, 0, (__simd::c_bcast<T>), "simd_broadcast_first"); }
template <class T> inline T quad_shuffle(T x, ushort lane, __EMU_LOC) { return __EMU_COLL(T, x, lane, (__simd::c_shuffle<T, __simd::Q_IDX>), "quad_shuffle"); }
template <class T> inline T quad_shuffle_xor(T x, ushort mask, __EMU_LOC) { return __EMU_COLL(T, x, mask, (__simd::c_shuffle<T, __simd::Q_XOR>), "quad_shuffle_xor"); }
template <class T> inline T quad_shuffle_down(T x, ushort delta, __EMU_LOC) { return __EMU_COLL(T, x, delta, (__simd::c_shuffle<T, __simd::Q_DOWN>), "quad_shuffle_down"); }
template <class T> inline T quad_shuffle_up(T x, ushort delta, __EMU_LOC) { return __EMU_COLL(T, x, delta, (__simd::c_shuffle<T, __simd::Q_UP>), "quad_shuffle_up"); }
template <class T> inline T quad_broadcast(T x, ushort lane, __EMU_LOC) { return __EMU_COLL(T, x, lane, (__simd::c_shuffle<T, __simd::Q_IDX>), "quad_broadcast"); }
template <class T> inline T quad_sum(T x, __EMU_LOC) { return __EMU_COLL(T, x, 0, (__simd::c_quad_butterfly<T, __simd::add<T>>), "quad_sum"); }
template <class T> inline T quad_max(T x, __EMU_LOC) { return __EMU_COLL(T, x, 0, (__simd::c_quad_butterfly<T, __simd::vmax<T>>), "quad_max"); }
template <class T> inline T quad_min(T x, __EMU_LOC) { return __EMU_COLL(T, x, 0, (__simd::c_quad_butterfly<T, __simd::vmin<T>>), "quad_min"); }

struct simd_vote {
  typedef unsigned long long vote_t;
  vote_t v;
  constexpr explicit simd_vote(vote_t x = 0) : v(x) {}
  constexpr explicit operator vote_t() const { return v; }
  constexpr bool all() const { return v == 0xFFFFFFFFull; }
  constexpr bool any() const { return v != 0; }
};
inline bool simd_all(bool x, __EMU_LOC) { return __EMU_COLL(bool, x, 0, __simd::c_vote<0>, "simd_all"); }
inline bool simd_any(bool x, __EMU_LOC) { return __EMU_COLL(bool, x, 0, __simd::c_vote<1>, "simd_any"); }
inline simd_vote simd_ballot(bool x, __EMU_LOC) {
  __emu_u32 lane;
  __emu_simd_xchg* g = __emu_simd_enter(&lane);
  __emu::st(g->in[lane], x);
  __emu_simd_sync(__simd::c_vote<2>, "simd_ballot", __line, __file);
  return simd_vote(__emu::ld<unsigned long long>(g->out[lane]));
}
inline simd_vote simd_active_threads_mask() {
  __emu_u32 lane;
  __emu_simd_xchg* g = __emu_simd_enter(&lane);
  return simd_vote(g->nlanes == 32 ? 0xFFFFFFFFull : ((1ull << g->nlanes) - 1));
}
inline bool simd_is_first() { return __emu_lane() == 0; }
inline void simdgroup_barrier(mem_flags = mem_flags::mem_none, __EMU_LOC) {
  __emu_u32 lane;
  __emu_simd_enter(&lane);
  __emu_simd_sync(__simd::c_none, "simdgroup_barrier", __line, __file);
}

// ------------------------------------------------------------------ atomics
enum memory_order {
  memory_order_relaxed = 0,
  memory_order_consume = 1,
  memory_order_acquire = 2,
  memory_order_release = 3,
  memory_order_acq_rel = 4,
  memory_order_seq_cst = 5,
};
enum class thread_scope { thread_scope_thread, thread_scope_simdgroup, thread_scope_threadgroup, thread_scope_device };

template <class T>
struct atomic {
  typedef T __value_type;
  T __v;
};
typedef atomic<int> atomic_int;
typedef atomic<uint> atomic_uint;
typedef atomic<bool> atomic_bool;
typedef atomic<float> atomic_float;
typedef atomic<ulong> atomic_ulong;
typedef atomic<long> atomic_long;

// Generic over the (address-space qualified, for the lint) atomic object type A.
#define __EMU_AT typename A::__value_type
#define __EMU_AP(o) ((__EMU_AT*)&(o)->__v)
template <class A> inline __EMU_AT atomic_load_explicit(const volatile A* o, memory_order = memory_order_relaxed) {
  __EMU_AT r;
  __atomic_load(__EMU_AP(o), &r, __ATOMIC_SEQ_CST);
  return r;
}
template <class A> inline void atomic_store_explicit(volatile A* o, __EMU_AT v, memory_order = memory_order_relaxed) {
  __atomic_store(__EMU_AP(o), &v, __ATOMIC_SEQ_CST);
}
template <class A> inline __EMU_AT atomic_exchange_explicit(volatile A* o, __EMU_AT v, memory_order = memory_order_relaxed) {
  __EMU_AT r;
  __atomic_exchange(__EMU_AP(o), &v, &r, __ATOMIC_SEQ_CST);
  return r;
}
template <class A, class E>
inline bool atomic_compare_exchange_weak_explicit(volatile A* o, E* expected, __EMU_AT desired,
                                                  memory_order = memory_order_relaxed,
                                                  memory_order = memory_order_relaxed) {
  return __atomic_compare_exchange(__EMU_AP(o), (__EMU_AT*)expected, &desired, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);
}
template <class A, class E>
inline bool atomic_compare_exchange_strong_explicit(volatile A* o, E* expected, __EMU_AT desired,
                                                    memory_order = memory_order_relaxed,
                                                    memory_order = memory_order_relaxed) {
  return __atomic_compare_exchange(__EMU_AP(o), (__EMU_AT*)expected, &desired, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);
}
template <class A, class F> inline __EMU_AT __atomic_rmw(volatile A* o, F f) {
  typedef __EMU_AT T;
  T old = atomic_load_explicit(o);
  for (;;) {
    T nv = f(old);
    if (__atomic_compare_exchange(__EMU_AP(o), &old, &nv, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST)) return old;
  }
}
template <class A> inline __EMU_AT atomic_fetch_add_explicit(volatile A* o, __EMU_AT v, memory_order = memory_order_relaxed) {
  typedef __EMU_AT T;
  if constexpr (is_integral_v<T>) return __atomic_fetch_add(__EMU_AP(o), v, __ATOMIC_SEQ_CST);
  else return __atomic_rmw(o, [v](T a) { return (T)(a + v); });
}
template <class A> inline __EMU_AT atomic_fetch_sub_explicit(volatile A* o, __EMU_AT v, memory_order = memory_order_relaxed) {
  typedef __EMU_AT T;
  if constexpr (is_integral_v<T>) return __atomic_fetch_sub(__EMU_AP(o), v, __ATOMIC_SEQ_CST);
  else return __atomic_rmw(o, [v](T a) { return (T)(a - v); });
}
template <class A> inline __EMU_AT atomic_fetch_and_explicit(volatile A* o, __EMU_AT v, memory_order = memory_order_relaxed) {
  return __atomic_fetch_and(__EMU_AP(o), v, __ATOMIC_SEQ_CST);
}
template <class A> inline __EMU_AT atomic_fetch_or_explicit(volatile A* o, __EMU_AT v, memory_order = memory_order_relaxed) {
  return __atomic_fetch_or(__EMU_AP(o), v, __ATOMIC_SEQ_CST);
}
template <class A> inline __EMU_AT atomic_fetch_xor_explicit(volatile A* o, __EMU_AT v, memory_order = memory_order_relaxed) {
  return __atomic_fetch_xor(__EMU_AP(o), v, __ATOMIC_SEQ_CST);
}
template <class A> inline __EMU_AT atomic_fetch_min_explicit(volatile A* o, __EMU_AT v, memory_order = memory_order_relaxed) {
  typedef __EMU_AT T;
  return __atomic_rmw(o, [v](T a) { return v < a ? v : a; });
}
template <class A> inline __EMU_AT atomic_fetch_max_explicit(volatile A* o, __EMU_AT v, memory_order = memory_order_relaxed) {
  typedef __EMU_AT T;
  return __atomic_rmw(o, [v](T a) { return a < v ? v : a; });
}
#undef __EMU_AT
#undef __EMU_AP
inline void atomic_thread_fence(mem_flags, memory_order, thread_scope = thread_scope::thread_scope_device) {
  __atomic_thread_fence(__ATOMIC_SEQ_CST);
}

// ------------------------------------------------------------------ simdgroup_matrix (8x8)
// Lane layout as in MLX's steel mma.h: lane l holds row (q & 4) + ((l / 2) % 4)
// with q = l / 4, columns c and c + 1 with c = (q & 2) * 2 + (l % 2) * 2.
inline void __sg_coord(__emu_u32 l, int* r, int* c) {
  int q = (int)l / 4;
  *r = (q & 4) + (((int)l / 2) % 4);
  *c = (q & 2) * 2 + ((int)l % 2) * 2;
}
template <class T, int Rows, int Cols>
struct simdgroup_matrix {
  static_assert(Rows == 8 && Cols == 8, "the emulator supports 8x8 simdgroup matrices");
  vec<T, 2> __e;
  simdgroup_matrix() = default;
  explicit simdgroup_matrix(T diag) {
    int r, c;
    __sg_coord(__emu_lane(), &r, &c);
    __e[0] = r == c ? diag : (T)0;
    __e[1] = r == c + 1 ? diag : (T)0;
  }
  vec<T, 2>& thread_elements() { return __e; }
  const vec<T, 2>& thread_elements() const { return __e; }
};
typedef simdgroup_matrix<float, 8, 8> simdgroup_float8x8;
typedef simdgroup_matrix<half, 8, 8> simdgroup_half8x8;
typedef simdgroup_matrix<bfloat, 8, 8> simdgroup_bfloat8x8;

template <class T, int R, int C>
inline simdgroup_matrix<T, R, C> make_filled_simdgroup_matrix(T v) {
  simdgroup_matrix<T, R, C> m;
  m.__e = vec<T, 2>{v, v};
  return m;
}
// Metal's simdgroup_load / simdgroup_store take device or threadgroup pointers only.
template <class U> struct __in_constant_space : false_type {};
#if defined(__EMU_LINT) || defined(__EMU_ADDRSPACE)
template <class U> struct __in_constant_space<__attribute__((address_space(2))) U> : true_type {};
template <class U> struct __in_constant_space<const __attribute__((address_space(2))) U> : true_type {};
#endif
template <class T, int R, int C, class U>
inline void simdgroup_load(simdgroup_matrix<T, R, C>& d, const U* src, ulong elements_per_row = C,
                           vec<ulong, 2> origin = vec<ulong, 2>(0), bool transpose = false) {
  static_assert(!__in_constant_space<const U>::value,
                "simdgroup_load reads device or threadgroup memory, not constant");
  int r, c;
  __sg_coord(__emu_lane(), &r, &c);
  for (int j = 0; j < 2; ++j) {
    ulong row = transpose ? (ulong)(c + j) : (ulong)r;
    ulong col = transpose ? (ulong)r : (ulong)(c + j);
    d.__e[j] = (T)src[(origin.y + row) * elements_per_row + origin.x + col];
  }
}
template <class T, int R, int C, class U>
inline void simdgroup_store(const simdgroup_matrix<T, R, C>& a, U* dst, ulong elements_per_row = C,
                            vec<ulong, 2> origin = vec<ulong, 2>(0), bool transpose = false) {
  int r, c;
  __sg_coord(__emu_lane(), &r, &c);
  for (int j = 0; j < 2; ++j) {
    ulong row = transpose ? (ulong)(c + j) : (ulong)r;
    ulong col = transpose ? (ulong)r : (ulong)(c + j);
    dst[(origin.y + row) * elements_per_row + origin.x + col] = (U)a.__e[j];
  }
}
namespace __simd {
template <class TD, class TA, class TB, class TC, bool ACC>
void c_mma(__emu_simd_xchg* g) {
  struct Frag { vec<TA, 2> a; vec<TB, 2> b; vec<TC, 2> c; };
  float A[8][8], B[8][8], Cm[8][8];
  for (int l = 0; l < 32; ++l) {
    Frag f = ld<Frag>(g->in[l]);
    int r, c;
    __sg_coord((__emu_u32)l, &r, &c);
    for (int j = 0; j < 2; ++j) {
      A[r][c + j] = (float)f.a[j];
      B[r][c + j] = (float)f.b[j];
      Cm[r][c + j] = ACC ? (float)f.c[j] : 0.0f;
    }
  }
  for (int l = 0; l < 32; ++l) {
    int r, c;
    __sg_coord((__emu_u32)l, &r, &c);
    vec<TD, 2> d;
    for (int j = 0; j < 2; ++j) {
      float acc = 0.0f;
      for (int k = 0; k < 8; ++k) acc += A[r][k] * B[k][c + j];
      d[j] = (TD)(acc + Cm[r][c + j]);
    }
    st(g->out[l], d);
  }
}
}  // namespace __simd
template <class TD, class TA, class TB, class TC>
inline void simdgroup_multiply_accumulate(simdgroup_matrix<TD, 8, 8>& d, const simdgroup_matrix<TA, 8, 8>& a,
                                          const simdgroup_matrix<TB, 8, 8>& b, const simdgroup_matrix<TC, 8, 8>& c,
                                          __EMU_LOC) {
  struct Frag { vec<TA, 2> a; vec<TB, 2> b; vec<TC, 2> c; };
  static_assert(sizeof(Frag) <= __EMU_SLOT, "fragment too large");
  __emu_u32 lane;
  __emu_simd_xchg* g = __emu_simd_enter(&lane);
  if (g->nlanes != 32) __emu_fail("simdgroup_multiply_accumulate needs a full simdgroup of 32 threads", __line, __file);
  Frag f{a.__e, b.__e, c.__e};
  __emu::st(g->in[lane], f);
  __emu_simd_sync(__simd::c_mma<TD, TA, TB, TC, true>, "simdgroup_multiply_accumulate", __line, __file);
  d.__e = __emu::ld<vec<TD, 2>>(g->out[lane]);
}
template <class TD, class TA, class TB>
inline void simdgroup_multiply(simdgroup_matrix<TD, 8, 8>& d, const simdgroup_matrix<TA, 8, 8>& a,
                               const simdgroup_matrix<TB, 8, 8>& b, __EMU_LOC) {
  struct Frag { vec<TA, 2> a; vec<TB, 2> b; vec<TD, 2> c; };
  __emu_u32 lane;
  __emu_simd_xchg* g = __emu_simd_enter(&lane);
  if (g->nlanes != 32) __emu_fail("simdgroup_multiply needs a full simdgroup of 32 threads", __line, __file);
  Frag f{a.__e, b.__e, vec<TD, 2>(0)};
  __emu::st(g->in[lane], f);
  __emu_simd_sync(__simd::c_mma<TD, TA, TB, TD, false>, "simdgroup_multiply", __line, __file);
  d.__e = __emu::ld<vec<TD, 2>>(g->out[lane]);
}

}  // namespace metal

// ------------------------------------------------------------------ threadgroup variables
// The emulator rewrites `threadgroup T name[N];` declarations into
// `auto& name = __emu_tg_var<T[N], ID>("name", __LINE__, __FILE__);`: one
// shared, poisoned slot per threadgroup in the worker's arena.
#if defined(__EMU_LINT) || defined(__EMU_ADDRSPACE)
#define __EMU_TG_SPACE __attribute__((address_space(3)))
#else
#define __EMU_TG_SPACE
#endif
template <class A, int ID>
inline __EMU_TG_SPACE A& __emu_tg_var(const char* name, int line, const char* file) {
  static const char key = 0;
  return *(__EMU_TG_SPACE A*)__emu_tg_alloc(&key, sizeof(A), name, line, file);
}

using namespace metal;

// ------------------------------------------------------------------ MLX utils.h preamble (subset)
template <typename U>
struct Limits {
  static constexpr U max = metal::numeric_limits<U>::max();
  static constexpr U min = metal::numeric_limits<U>::min();
  static constexpr U finite_max = metal::numeric_limits<U>::max();
  static constexpr U finite_min = metal::numeric_limits<U>::min();
};
#define __EMU_FLOAT_LIMIT(T)                                               \
  template <>                                                              \
  struct Limits<T> {                                                       \
    static constexpr T max = metal::numeric_limits<T>::infinity();         \
    static constexpr T min = -metal::numeric_limits<T>::infinity();        \
    static constexpr T finite_max = metal::numeric_limits<T>::max();       \
    static constexpr T finite_min = -metal::numeric_limits<T>::max();      \
  };
__EMU_FLOAT_LIMIT(float)
__EMU_FLOAT_LIMIT(half)
__EMU_FLOAT_LIMIT(bfloat)
#undef __EMU_FLOAT_LIMIT
template <>
struct Limits<bool> {
  static constexpr bool max = true;
  static constexpr bool min = false;
};

template <typename IdxT = int64_t, typename E, typename SH, typename S, enable_if_t<!__vt<E>::is, int> = 0>
METAL_FUNC IdxT elem_to_loc(E elem, const SH* shape, const S* strides, int ndim) {
  IdxT loc = 0;
  IdxT e = (IdxT)elem;
  for (int i = ndim - 1; i >= 0 && e > 0; --i) {
    loc += (IdxT)(e % shape[i]) * (IdxT)strides[i];
    e /= shape[i];
  }
  return loc;
}
template <typename IdxT = int64_t, typename SH, typename S>
METAL_FUNC IdxT elem_to_loc(vec<uint, 3> elem, const SH* shape, const S* strides, int ndim) {
  IdxT loc = (IdxT)elem.x * (IdxT)strides[ndim - 1] + (IdxT)elem.y * (IdxT)strides[ndim - 2];
  for (int d = ndim - 3; d >= 0; --d) {
    loc += (IdxT)(elem.z % shape[d]) * (IdxT)strides[d];
    elem.z /= shape[d];
  }
  return loc;
}
template <typename IdxT = int64_t, typename S>
METAL_FUNC IdxT elem_to_loc_1(uint elem, S stride) { return (IdxT)elem * (IdxT)stride; }
template <typename IdxT = int64_t, typename S>
METAL_FUNC IdxT elem_to_loc_2(vec<uint, 2> elem, const S* strides) {
  return (IdxT)elem.x * (IdxT)strides[1] + (IdxT)elem.y * (IdxT)strides[0];
}
template <typename IdxT = int64_t, typename S>
METAL_FUNC IdxT elem_to_loc_3(vec<uint, 3> elem, const S* strides) {
  return (IdxT)elem.x * (IdxT)strides[2] + (IdxT)elem.y * (IdxT)strides[1] + (IdxT)elem.z * (IdxT)strides[0];
}
inline size_t ceildiv(size_t N, size_t M) { return (N + M - 1) / M; }
inline float log1p(float x) {
  float xp1 = 1.0f + x;
  if (xp1 == Limits<float>::max) return Limits<float>::max;
  if (xp1 == 1.0f) return x;
  return x * (metal::log(xp1) / (xp1 - 1.0f));
}
inline bfloat16_t log1p(bfloat16_t x) {
  float xp1 = 1.0f + (float)x;
  if (xp1 == Limits<float>::max) return Limits<bfloat16_t>::max;
  if (xp1 == 1.0f) return x;
  return (bfloat16_t)((float)x * (metal::log(xp1) / (xp1 - 1.0f)));
}

// ------------------------------------------------------------------ MSL keywords and constructors
#if defined(__EMU_LINT) || defined(__EMU_ADDRSPACE)
// The lint, and the emulator's builds, type Metal's address spaces as distinct clang
// address spaces (no implicit conversion between them, as in Metal).
#define device __attribute__((address_space(1)))
#define constant __attribute__((address_space(2)))
#define threadgroup __attribute__((address_space(3)))
#define thread
#else
#define device
#define constant
#define thread
#define threadgroup
#endif
#define ray_data
#define object_data
#define kernel

// vector constructors, e.g. float4(x), float4(a.xy, b.zw)
#define float2(...) ::__emu::make_vec<float, 2>(__VA_ARGS__)
#define float3(...) ::__emu::make_vec<float, 3>(__VA_ARGS__)
#define float4(...) ::__emu::make_vec<float, 4>(__VA_ARGS__)
#define half2(...) ::__emu::make_vec<half, 2>(__VA_ARGS__)
#define half3(...) ::__emu::make_vec<half, 3>(__VA_ARGS__)
#define half4(...) ::__emu::make_vec<half, 4>(__VA_ARGS__)
#define bfloat2(...) ::__emu::make_vec<bfloat, 2>(__VA_ARGS__)
#define bfloat3(...) ::__emu::make_vec<bfloat, 3>(__VA_ARGS__)
#define bfloat4(...) ::__emu::make_vec<bfloat, 4>(__VA_ARGS__)
#define int2(...) ::__emu::make_vec<int, 2>(__VA_ARGS__)
#define int3(...) ::__emu::make_vec<int, 3>(__VA_ARGS__)
#define int4(...) ::__emu::make_vec<int, 4>(__VA_ARGS__)
#define uint2(...) ::__emu::make_vec<uint, 2>(__VA_ARGS__)
#define uint3(...) ::__emu::make_vec<uint, 3>(__VA_ARGS__)
#define uint4(...) ::__emu::make_vec<uint, 4>(__VA_ARGS__)
#define short2(...) ::__emu::make_vec<short, 2>(__VA_ARGS__)
#define short3(...) ::__emu::make_vec<short, 3>(__VA_ARGS__)
#define short4(...) ::__emu::make_vec<short, 4>(__VA_ARGS__)
#define ushort2(...) ::__emu::make_vec<ushort, 2>(__VA_ARGS__)
#define ushort3(...) ::__emu::make_vec<ushort, 3>(__VA_ARGS__)
#define ushort4(...) ::__emu::make_vec<ushort, 4>(__VA_ARGS__)
#define char2(...) ::__emu::make_vec<char, 2>(__VA_ARGS__)
#define char3(...) ::__emu::make_vec<char, 3>(__VA_ARGS__)
#define char4(...) ::__emu::make_vec<char, 4>(__VA_ARGS__)
#define uchar2(...) ::__emu::make_vec<uchar, 2>(__VA_ARGS__)
#define uchar3(...) ::__emu::make_vec<uchar, 3>(__VA_ARGS__)
#define uchar4(...) ::__emu::make_vec<uchar, 4>(__VA_ARGS__)
#define bool2(...) ::__emu::make_vec<bool, 2>(__VA_ARGS__)
#define bool3(...) ::__emu::make_vec<bool, 3>(__VA_ARGS__)
#define bool4(...) ::__emu::make_vec<bool, 4>(__VA_ARGS__)
#define long2(...) ::__emu::make_vec<long, 2>(__VA_ARGS__)
#define long4(...) ::__emu::make_vec<long, 4>(__VA_ARGS__)
#define ulong2(...) ::__emu::make_vec<ulong, 2>(__VA_ARGS__)
#define ulong4(...) ::__emu::make_vec<ulong, 4>(__VA_ARGS__)
#define packed_float2(...) ((packed_float2)::__emu::make_vec<float, 2>(__VA_ARGS__))
#define packed_float4(...) ((packed_float4)::__emu::make_vec<float, 4>(__VA_ARGS__))
#define packed_half2(...) ((packed_half2)::__emu::make_vec<half, 2>(__VA_ARGS__))
#define packed_half4(...) ((packed_half4)::__emu::make_vec<half, 4>(__VA_ARGS__))
#define packed_float3(...) (::metal::__packed3<float>(::__emu::make_vec<float, 3>(__VA_ARGS__)))
#define packed_half3(...) (::metal::__packed3<half>(::__emu::make_vec<half, 3>(__VA_ARGS__)))

#define static_cast ::__emu::scast
