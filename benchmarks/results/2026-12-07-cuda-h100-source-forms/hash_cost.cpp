#include <string>
#include <chrono>
#include <cstdio>
#include <functional>
int main(){
  for (int kb : {1, 4, 16, 64}) {
    std::string s(kb*1024, 'x');
    for (size_t i=0;i<s.size();i++) s[i] = char('a' + (i*7)%26);
    size_t acc=0; int reps = 200000/kb;
    auto t0=std::chrono::steady_clock::now();
    for(int r=0;r<reps;r++){ s[r%s.size()]^=1; acc+=std::hash<std::string>{}(s);}
    auto t1=std::chrono::steady_clock::now();
    double us=std::chrono::duration<double,std::micro>(t1-t0).count()/reps;
    std::printf("%d KiB: %.3f us per hash, %.3f us per KiB (%zu)\n", kb, us, us/kb, acc&1);
  }
}
